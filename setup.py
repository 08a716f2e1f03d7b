"""Build of the optional C decoder, encoder, step aggregation and call buffer
(rtxops/telemetry/_native); everything else is in pyproject.toml. ``optional=True``: without a
compiler the package still installs and uses the pure-Python paths."""
from setuptools import Extension, setup


def _native(name: str, source: str) -> Extension:
    return Extension(f"rtxops.telemetry.{name}", [f"rtxops/telemetry/_native/{source}"],
                     extra_compile_args=["-O2", "-std=c11"], optional=True)


setup(ext_modules=[_native("_otlp_columns", "otlp_columns.c"), _native("_otlp_encode", "otlp_encode.c"),
                   _native("_aggregate", "aggregate.c"), _native("_call_buffer", "call_buffer.c")])
