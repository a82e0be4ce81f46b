"""prism_megatron: run one (or a few) ranks of an N-rank megatron-core job for real, the rest as ghosts.

    import prism_megatron
    inst = prism_megatron.install(cfg)   # before torch.distributed.init_process_group
    ...unmodified megatron-core training code...
"""

from prism_megatron.config import ConfigError, PrismConfig, load_config
from prism_megatron.hooks.install import Installation, install

__all__ = ["ConfigError", "Installation", "PrismConfig", "install", "load_config"]
__version__ = "0.1.0"
