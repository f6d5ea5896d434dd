"""Where the time goes: per-step timing on every worker, the reports' maths, the progress display."""
