"""Configs as data: frozen dataclasses loaded from YAML, with dotted ``key=value`` overrides.

Every architectural choice of K3, K2 (DeepSeek-V3 layout) and Kimi Linear is a field here, so one
code path covers all three. Modules: ``fields`` (errors, the ``runtime`` mark, choice checks),
``model_config`` (the model), ``run_config`` (training, mesh, the whole ``Config``), ``loading``
(YAML, overrides, dicts). ``from k3jax.config import X`` reaches every public name.
"""

from k3jax.config.fields import ConfigError, runtime_fields, without_runtime_fields
from k3jax.config.loading import CONFIG_DIR, from_dict, load_config, parse_overrides, resolve_path, to_dict
from k3jax.config.model_config import AttnResConfig, KDAConfig, MLAConfig, MoEConfig, ModelConfig, QuantConfig, \
    VisionConfig, YarnConfig
from k3jax.config.rl_config import RLConfig
from k3jax.config.run_config import LORA_SITES, Config, DataConfig, LoRAConfig, MeshConfig, OptimConfig, ProfileConfig, \
    TrainConfig, WandbConfig

__all__ = ["CONFIG_DIR", "LORA_SITES", "AttnResConfig", "Config", "ConfigError", "DataConfig", "KDAConfig", "LoRAConfig", "MLAConfig", "MeshConfig",
           "MoEConfig", "ModelConfig", "OptimConfig", "ProfileConfig", "QuantConfig", "RLConfig", "TrainConfig", "VisionConfig",
           "WandbConfig", "YarnConfig",
           "from_dict", "load_config", "parse_overrides", "resolve_path", "runtime_fields", "to_dict",
           "without_runtime_fields"]
