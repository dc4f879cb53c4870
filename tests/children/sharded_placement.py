"""``from_hf`` onto a 2 x 2 mesh of 4 devices places each leaf by the rules given (the embedding over
``model``, routed experts over ``data``) with the values of the unsharded load. Run by
``tests/test_hf_interop.py``; argv: the checkpoint directory."""

import sys

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from k3jax.interop import from_hf
from k3jax.interop.model_leaves import model_variables


def main(path: str) -> None:
    assert len(jax.devices()) == 4
    mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "model"))
    rules = {"vocab": "model", "expert": "data", "heads": "model", "mlp": "model"}
    m = from_hf(path, mesh=mesh, rules=rules, overrides=["kda.chunk_size=8"])
    ref = from_hf(path, overrides=["kda.chunk_size=8"])
    v = model_variables(m)
    assert v[("embed",)].get_raw_value().sharding == NamedSharding(mesh, P("model", None))
    w = [x for p, x in v.items() if p[-1] == "w_gate" and x.get_raw_value().ndim == 3][0]
    assert w.get_raw_value().sharding.spec == P("data", None, None), w.get_raw_value().sharding
    for p, x in v.items():
        np.testing.assert_array_equal(np.asarray(x.get_raw_value()), np.asarray(model_variables(ref)[p].get_raw_value()))
    print("OK")


if __name__ == "__main__":
    main(sys.argv[1])
