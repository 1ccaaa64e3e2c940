import sys
from pathlib import Path

# config_runs.py, the document builder beside these tests, imports as a plain module.
sys.path.insert(0, str(Path(__file__).parent))
