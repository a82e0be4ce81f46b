"""Build a validated `PrismConfig` from YAML files, presets and `key=value` overrides.

Order of precedence (later wins): dataclass defaults, `--prism-config FILE` (whose `model: <preset>`
comes before its own model fields), a `model=<preset>` override (which replaces the file's model
section, as a Hydra config group choice does), then dotted overrides such as `parallel.tp=8`. Every failure (unknown key, wrong type, a size that does not
divide) becomes one `ConfigError` line.
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Iterable, Optional

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from prism_megatron.config.schema import SECTIONS, ConfigError, ModelConfig, PrismConfig

MODEL_PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(),
    # Small enough for CPU, big enough that routing is non-trivial: 8 experts, top-2.
    "tiny_moe": ModelConfig(num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=128),
    # Published shapes (the papers' and model cards' layer counts, widths, heads, FFN sizes, vocab).
    "gpt3_175b": ModelConfig(num_layers=96, hidden_size=12288, num_attention_heads=96, ffn_hidden_size=49152,
                             vocab_size=50257, seq_length=2048, params_dtype="bf16", tie_embeddings=True),
    "llama3_8b": ModelConfig(num_layers=32, hidden_size=4096, num_attention_heads=32, num_query_groups=8,
                             ffn_hidden_size=14336, vocab_size=128256, seq_length=8192, swiglu=True,
                             tie_embeddings=False, params_dtype="bf16"),
    "llama3_70b": ModelConfig(num_layers=80, hidden_size=8192, num_attention_heads=64, num_query_groups=8,
                              ffn_hidden_size=28672, vocab_size=128256, seq_length=8192, swiglu=True,
                              tie_embeddings=False, params_dtype="bf16"),
    "llama3_405b": ModelConfig(num_layers=126, hidden_size=16384, num_attention_heads=128, num_query_groups=8,
                               ffn_hidden_size=53248, vocab_size=128256, seq_length=8192, swiglu=True,
                               tie_embeddings=False, params_dtype="bf16"),
    "mixtral_8x7b": ModelConfig(num_layers=32, hidden_size=4096, num_attention_heads=32, num_query_groups=8,
                                ffn_hidden_size=14336, num_experts=8, moe_router_topk=2,
                                moe_ffn_hidden_size=14336, vocab_size=32000, seq_length=4096, swiglu=True,
                                tie_embeddings=False, params_dtype="bf16"),
    # DeepSeek-V3's widths and routing (61 layers, 256 routed experts of 2048, top-8), every layer MoE
    # and plain attention: no MLA, shared expert, dense first layers or multi-token prediction.
    "deepseek_v3_shaped": ModelConfig(num_layers=61, hidden_size=7168, num_attention_heads=128,
                                      ffn_hidden_size=18432, num_experts=256, moe_router_topk=8,
                                      moe_ffn_hidden_size=2048, vocab_size=129280, seq_length=4096,
                                      swiglu=True, tie_embeddings=False, params_dtype="bf16"),
}
"""Model presets selectable as `model=<name>` (the Hydra config-group spelling)."""


def _preset(name: str) -> ModelConfig:
    if name not in MODEL_PRESETS:
        raise ConfigError(f"model={name!r} is not a preset; expected one of "
                          f"{', '.join(sorted(MODEL_PRESETS))}")
    return replace(MODEL_PRESETS[name])


def _preset_layer(name: str):
    """The model section of preset `name`, alone (other sections stay as the layers below say)."""
    return OmegaConf.create({"model": OmegaConf.structured(_preset(name))})


def load_config(overrides: Iterable[str] = (), config_file: Optional[str] = None) -> PrismConfig:
    """Merge defaults, an optional YAML file and `key=value` overrides; validate; return the dataclass."""
    base = OmegaConf.structured(PrismConfig)
    overrides = list(overrides)
    presets = [o for o in overrides if o.startswith("model=")]
    dotted = [o for o in overrides if not o.startswith("model=")]
    for item in dotted:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not key=value; write e.g. parallel.tp=8")
    try:
        layers = [base]
        if config_file is not None:
            if not os.path.isfile(config_file):
                raise ConfigError(f"config file {config_file!r} {_not_a_file(config_file)}; give a YAML path")
            file_cfg = _read_yaml(config_file)
            if presets and "model" in file_cfg:
                # `model=NAME` on the command line chooses the model as a Hydra config group does:
                # the file's model (its preset and its fields) gave way, the command line's wins
                file_cfg.pop("model")
            elif "model" in file_cfg and isinstance(file_cfg.model, str):
                layers.append(_preset_layer(file_cfg.pop("model")))  # the file's fields refine it
            layers.append(file_cfg)
        for item in presets:
            layers.append(_preset_layer(item.split("=", 1)[1]))
        layers.append(OmegaConf.from_dotlist(dotted))
        merged = OmegaConf.merge(*layers)
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as err:
        first = str(err).strip().splitlines()[0]
        key = getattr(err, "full_key", None)
        where = f"{key}: " if key and key not in first else ""  # which key a bad value was given to
        raise ConfigError(f"invalid config: {where}{first}{_close_match(first)}; see `prism-megatron config "
                          "--keys`") from None


def check_config_file(path: str) -> None:
    """Fail fast (one ConfigError line) on a config file that is missing, not YAML, or has a key or
    value type the schema does not know; the checks across keys wait for the overrides."""
    if not os.path.isfile(path):
        raise ConfigError(f"config file {path!r} {_not_a_file(path)}; give a YAML path")
    file_cfg = _read_yaml(path)
    try:
        if isinstance(file_cfg.get("model"), str):
            _preset(file_cfg.pop("model"))
        OmegaConf.merge(OmegaConf.structured(PrismConfig), file_cfg)
    except OmegaConfBaseException as err:
        raise ConfigError(f"invalid config file {path!r}: {str(err).strip().splitlines()[0]}"
                          f"{_close_match(str(err))}; see `prism-megatron config --keys`") from None


def _not_a_file(path: str) -> str:
    return "is a folder, not a file" if os.path.isdir(path) else "does not exist"


def _read_yaml(path: str):
    """The config file as an omegaconf mapping, or one ConfigError line saying where it is broken."""
    try:
        cfg = OmegaConf.load(path)
    except UnicodeDecodeError as err:
        raise ConfigError(f"config file {path!r} is not UTF-8 text (byte {err.start}: {err.reason}); save "
                          "it as UTF-8") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or str(err).strip().splitlines()[0]
        raise ConfigError(f"config file {path!r} is not valid YAML{where}: {problem}; fix it (indent with "
                          "spaces, not tabs; each key once)") from None
    except OSError as err:
        raise ConfigError(f"config file {path!r} cannot be read ({err.strerror}); give a readable YAML "
                          "file") from None
    if not isinstance(cfg, DictConfig):
        raise ConfigError(f"config file {path!r} holds a list, expected a mapping of sections (parallel:, "
                          "model:, train: ...); see `prism-megatron config --keys`")
    return cfg


def _close_match(message: str) -> str:
    """'; did you mean parallel.tp?' for omegaconf's "Key 'tpp' not in 'ParallelConfig'"."""
    import difflib
    import re
    from dataclasses import fields

    m = re.search(r"Key '([^']+)' not in '([A-Za-z]+)'", message)
    if not m:
        return ""
    key, owner = m.groups()
    if owner == "PrismConfig":
        close = difflib.get_close_matches(key, list(SECTIONS), n=1)
        return f"; did you mean {close[0]}?" if close else ""
    for name, section in SECTIONS.items():
        if section.__name__ == owner:
            close = difflib.get_close_matches(key, [f.name for f in fields(section)], n=1)
            return f"; did you mean {name}.{close[0]}?" if close else ""
    return ""


def to_yaml(cfg: PrismConfig) -> str:
    """The resolved config as YAML (what every result records next to its figures)."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))
