"""Telemetry: the hot-path recorder, span building and export, the OTLP receiver and the DuckDB store."""
