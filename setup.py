"""Build of the optional C decoder (rtxops/telemetry/_native); everything else is in pyproject.toml.
``optional=True``: without a compiler the package still installs and uses the pure-Python decoder."""
from setuptools import Extension, setup

setup(ext_modules=[Extension("rtxops.telemetry._otlp_columns", ["rtxops/telemetry/_native/otlp_columns.c"],
                             extra_compile_args=["-O2", "-std=c11"], optional=True)])
