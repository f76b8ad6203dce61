"""Speed and memory benchmarks of mumoe_tn (run ``python -m benchmarks.run``)."""
