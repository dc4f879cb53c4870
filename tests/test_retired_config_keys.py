"""Config keys that are gone (``k3jax.config.loading.RETIRED_KEYS``): a checkpoint written before carries
them in its saved config, which still loads when each holds the one value it could take; any other value,
and the key in a YAML file or an override, is an unknown key as always."""

import pytest

from k3jax.config import from_dict, load_config, to_dict
from k3jax.config.fields import ConfigError
from k3jax.config.loading import RETIRED_KEYS


def saved_with(value):
    """The ``tiny`` config as an earlier version saved it: with ``model.moe.router_dtype``."""
    data = to_dict(load_config("tiny"))
    data["model"]["moe"]["router_dtype"] = value
    return data


def test_router_dtype_is_retired():
    assert RETIRED_KEYS == {("model", "moe", "router_dtype"): "float32"}
    old = saved_with("float32")
    assert from_dict(old) == load_config("tiny")
    assert old["model"]["moe"]["router_dtype"] == "float32"  # the caller's dict is left as it was
    with pytest.raises(ConfigError, match=r"model\.moe\.router_dtype: unknown key"):
        from_dict(saved_with("bfloat16"))
    with pytest.raises(ConfigError, match=r"model\.moe\.router_dtype: unknown key"):
        load_config("tiny", ["model.moe.router_dtype=float32"])
