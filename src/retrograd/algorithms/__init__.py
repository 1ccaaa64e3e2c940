"""One plain loop per algorithm, and the parts they share (context, step, evaluation)."""
