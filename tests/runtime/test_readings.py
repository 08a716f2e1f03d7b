"""CallStats: the readings a run without telemetry keeps."""
from rtxops.runtime.readings import MAX_ERRORS_KEPT, CallStats, Slot


def test_errors_are_bounded_and_the_rest_counted():
    stats = CallStats()
    stats.register_slot(Slot(0, "softmax", "eager", "{}", "b", "F.softmax", "eager"))
    for i in range(MAX_ERRORS_KEPT + 25):
        stats.error(0, f"failure {i}")
    assert len(stats.errors) == MAX_ERRORS_KEPT
    assert stats.errors[0] == (0, "failure 0")
    assert stats.errors_dropped == 25
