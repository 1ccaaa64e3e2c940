"""The RULER LLM judge (formats.md §3.2-3.4): prompts, strategies, client, cache and judge."""
