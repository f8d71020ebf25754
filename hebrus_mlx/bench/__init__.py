"""`hebrus-mlx bench`: the user-facing benchmark harness (harness: configurations, A/B/B/A schedule,
runs, metrics, refusal; machine: the machine record and SSD probe; report: JSON, markdown, PNG)."""
