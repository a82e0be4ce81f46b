"""Recording one rank's execution: the recorder, device clocks, and the hooks that feed them."""

from prism_megatron.trace.recorder import Recorder, RecorderError

__all__ = ["Recorder", "RecorderError"]
