"""Where a C compiler exists (CI included), the install built the C decoder, encoder, step
aggregation and call buffer: a source that stopped compiling would otherwise leave every job on
the slower Python paths unnoticed."""
from __future__ import annotations

import shutil
import sysconfig

from rtxops.telemetry import _columns, encode, recorder, spans


def test_the_c_decoder_encoder_and_aggregation_are_built_where_a_compiler_is():
    compiler = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(compiler) is None:  # the documented fallback: pure Python, still correct
        assert encode._otlp_encode is None or encode._otlp_encode.encode([]) == b""
        return
    assert _columns._otlp_columns is not None, "rtxops/telemetry/_native/otlp_columns.c did not build"
    assert encode._otlp_encode is not None, "rtxops/telemetry/_native/otlp_encode.c did not build"
    assert spans._aggregate_native is not None, "rtxops/telemetry/_native/aggregate.c did not build"
    assert recorder._NativeCallBuffer is not None, "rtxops/telemetry/_native/call_buffer.c did not build"
