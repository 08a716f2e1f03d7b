"""The evolve loop: find hot buckets in telemetry, gate and try candidate variants inside real
training steps or offline, promote winners with confidence, canary them, roll back regressions."""
