"""RL on a two-layer tiny K3 with a latent MoE (k3jax/rl): the engine's rollouts on the trainer's weights, routing
replay (the training forward selects exactly the experts the decode steps recorded, every token and layer), the
rollout log-probabilities against the trainer's recomputation, the mismatch with and without replay, and the
importance ratio at the first update."""

import numpy as np
import pytest
from flax import nnx

from k3jax.config import load_config
from k3jax.model import moe_layers
from k3jax.rl.environments import EnvTurn
from k3jax.rl.mismatch import logprob_mismatch, routing_disagreement
from k3jax.rl.objectives import token_weights
from k3jax.rl.rollout import rollout_seed, sample, training_rows
from k3jax.rl.step import TOKEN_SUMS, make_rl_step, make_score_fn
from k3jax.serving.engine import Engine
from k3jax.tokenizer import load_tokenizer
from k3jax.training.step import init_train_state

G, P, NEW = 4, 2, 6
SMALL_RL = ["model.num_layers=2", "model.attn_res.block_size=1", "train.seq_len=64", f"train.batch_size={G * P}",
            "train.rl.loss=grpo", f"train.rl.group_size={G}", f"train.rl.prompts_per_step={P}",
            f"train.rl.max_new_tokens={NEW}", "train.rl.updates_per_rollout=2"]
PROMPTS = ["In the beginning", "And God said, Let"]
BLOCK = 16  # the engine's prefill chunk and prefix-cache block


@pytest.fixture(scope="module")
def rollout():
    """A tiny MoE model's train state, a rollout of G completions of two prompts by the recording engine on its
    own arrays, the batch built from it and the scoring forward's outputs."""
    cfg = load_config("tiny", SMALL_RL)
    graphdef, state = nnx.split(init_train_state(cfg))
    model = nnx.merge(graphdef, state).model
    engine = Engine(model, max_batch=G * P, max_len=cfg.train.seq_len + 1, prefill_batch=G * P, prefill_chunk=16,
                    unroll_layers=False, record_routes=True, prefix_cache_tokens=G * P * 64, prefix_cache_block=BLOCK)
    tok = load_tokenizer("byte")
    completions = sample(engine, [tok.encode(p) for p in PROMPTS], G, max_new_tokens=NEW, temperature=1.0, top_p=1.0,
                         stop_ids=(), seeds=[rollout_seed(0, 0, i) for i in range(G * P)])
    batch = training_rows(completions, cfg.train.seq_len, cfg.model.moe.top_k, len(moe_layers(cfg.model)))
    scored = {k: np.asarray(v) for k, v in make_score_fn(graphdef, cfg)(state, batch).items()}
    return cfg, graphdef, state, engine, completions, batch, scored


def test_engine_decodes_with_the_trainers_arrays(rollout):
    _, graphdef, state, engine, *_ = rollout
    model_state = nnx.state(nnx.merge(graphdef, state).model)
    engine.set_weights(model_state)
    for a, b in zip(jax_leaves(engine._state), jax_leaves(model_state)):
        assert a is b  # the same arrays: no copy, no reshard
    with pytest.raises(ValueError, match="structure"):
        engine.set_weights({"not": "a model"})
    engine.release_weights()  # between rollouts the engine holds no weights and runs nothing
    with pytest.raises(RuntimeError, match="set_weights first"):
        sample(engine, [[1, 2, 3]], 1, max_new_tokens=2, temperature=1.0, top_p=1.0, stop_ids=(), seeds=[0])
    engine.set_weights(model_state)


def jax_leaves(tree):
    import jax

    return jax.tree.leaves(tree)


def test_rollout_rows_and_routes(rollout):
    cfg, *_, completions, batch, _ = rollout
    m, k = len(moe_layers(cfg.model)), cfg.model.moe.top_k
    assert m >= 1 and batch["routes"].shape == (G * P, cfg.train.seq_len, m, k)
    for i, c in enumerate(completions):
        assert len(c.tokens) == NEW and c.finish == "length"  # no stop ids: every completion runs to its limit
        n = len(c.prompt) + NEW - 1
        assert batch["mask"][i].sum() == NEW and batch["mask"][i, len(c.prompt) - 1] == 1
        np.testing.assert_array_equal(batch["targets"][i, len(c.prompt) - 1:n], c.tokens)
        assert c.routes.shape == (len(c.prompt) + NEW, m, k)
        # each token's experts are k distinct experts
        assert all(len(set(r.tolist())) == k for r in c.routes.reshape(-1, k))
    # the G completions of a prompt differ (their own seeds)
    assert len({tuple(c.tokens) for c in completions[:G]}) > 1


def test_replay_selects_the_recorded_experts(rollout):
    """The training forward with replay uses exactly the experts the rollout recorded, every token of every row
    in every MoE layer; without replay it picks its own top-k (the fraction that differs is printed)."""
    cfg, graphdef, state, *_ = rollout
    batch = rollout[5]
    model = nnx.merge(graphdef, state).model
    _, _, stats = model.forward(batch["tokens"], segment_ids=batch["segment_ids"], replay_routes=batch["routes"],
                                record_routes=True)
    real = batch["segment_ids"] > 0
    np.testing.assert_array_equal(np.asarray(stats.routes)[real], batch["routes"][real])
    # replay is what selects: other routes replayed are the ones used (each token's next k experts)
    shifted = (batch["routes"] + 1) % cfg.model.moe.num_experts
    _, _, other = model.forward(batch["tokens"], segment_ids=batch["segment_ids"], replay_routes=shifted,
                                record_routes=True)
    np.testing.assert_array_equal(np.asarray(other.routes)[real], shifted[real])
    free = rollout[6]["free_routes"]
    print(f"routing decisions that differ without replay: {routing_disagreement(batch['routes'], free, real):.4f}")


def test_rollout_logprobs_equal_the_trainers(rollout):
    """The engine's sampled log-probabilities equal the trainer's recomputation on the same weights (replay on)
    within float32 rounding, and replay brings the KL no higher than without it."""
    batch, scored = rollout[5], rollout[6]
    mask = batch["mask"] > 0
    np.testing.assert_allclose(scored["logp"][mask], batch["rollout_logp"][mask], atol=2e-5, rtol=0)
    with_replay = logprob_mismatch(batch["rollout_logp"], scored["logp"], batch["mask"])
    without = logprob_mismatch(batch["rollout_logp"], scored["free_logp"], batch["mask"])
    print(f"rollout/trainer mismatch with replay {with_replay}, without {without}")
    assert with_replay["kl_k3"] <= without["kl_k3"] + 1e-12
    assert with_replay["prob_pearson"] > 0.9999


def test_the_first_update_has_ratio_one(rollout):
    """With the scoring forward's log-probabilities as the old policy, the first update's importance ratio is 1
    (no token clipped), and the update moves the weights."""
    cfg, graphdef, state, _, completions, batch, scored = rollout
    import jax

    rewards = np.array([c.tokens[0] % 5 for c in completions], np.float32)  # any reward with variance
    groups = rewards.reshape(P, G)
    adv = ((groups - groups.mean(1, keepdims=True)) / (groups.std(1, ddof=1, keepdims=True) + 1e-4)).reshape(-1)
    full = dict(batch, advantages=adv, weights=np.asarray(token_weights(batch["mask"], "sequence")),
                old_logp=scored["logp"], ref_logp=np.zeros_like(scored["logp"]))
    step = make_rl_step(graphdef, cfg)
    before = jax.tree.map(np.asarray, state)
    new_state, metrics = step(jax.tree.map(lambda x: x.copy(), state), full)
    tokens = float(metrics["tokens"])
    assert tokens == batch["mask"].sum()
    assert abs(float(metrics["ratio"]) / tokens - 1.0) < 1e-5
    assert float(metrics["clipped_low"]) == 0 and float(metrics["clipped_high"]) == 0
    assert set(TOKEN_SUMS) <= set(metrics) and bool(metrics["finite"]) and float(metrics["grad_norm"]) > 0
    assert not bool(metrics["zero_gradient"])
    moved = [not np.array_equal(a, np.asarray(b)) for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(new_state))]
    assert any(moved)


def test_a_rollout_without_reward_variance_leaves_the_weights(rollout):
    """Every group got one reward: every advantage is zero, the gradient is zero, and the update keeps the state
    as it was (AdamW's momentum and weight decay would otherwise move the weights), optimizer count included."""
    cfg, graphdef, state, _, _, batch, scored = rollout
    import jax

    flat = dict(batch, advantages=np.zeros(G * P, np.float32),
                weights=np.asarray(token_weights(batch["mask"], "sequence")), old_logp=scored["logp"],
                ref_logp=np.zeros_like(scored["logp"]))
    step = make_rl_step(graphdef, cfg)
    before = jax.tree.map(np.asarray, state)
    new_state, metrics = step(jax.tree.map(lambda x: x.copy(), state), flat)
    assert bool(metrics["finite"]) and bool(metrics["zero_gradient"]) and float(metrics["grad_norm"]) == 0
    assert all(np.array_equal(a, np.asarray(b)) for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(new_state)))


def test_a_next_turn_resumes_from_the_cached_history_with_its_routes(rollout):
    """A recording engine's prefix cache keeps each block's routes: a turn whose prompt is the last turn's prompt,
    its reply and more prefills only what follows the last cached block (prompt and generated blocks), has every
    token's routes (the cached ones as they first ran), and samples what a full prefill samples."""
    _, graphdef, state, engine, *_ = rollout
    engine.set_weights(nnx.state(nnx.merge(graphdef, state).model))  # a new policy: the cache starts empty
    assert engine.prefix_cache.tokens == 0
    tok = load_tokenizer("byte")
    settings = dict(temperature=1.0, top_p=1.0, stop_ids=())
    (first,) = sample(engine, [tok.encode("In the beginning God created")], 1, max_new_tokens=12, seeds=[1],
                      **settings)
    history = first.prompt + first.tokens  # 28 + 12 tokens: cached blocks end at 16 (prompt) and 32 (reply)
    prompt = history + tok.encode(" and")
    metrics = engine.metrics
    prefilled, hit = metrics.prefill_tokens, metrics.prefix_hit_tokens
    (second,) = sample(engine, [prompt], 1, max_new_tokens=8, seeds=[2], **settings)
    assert metrics.prefix_hit_tokens - hit == 2 * BLOCK and metrics.prefill_tokens - prefilled == len(prompt) - 2 * BLOCK
    assert second.routes.shape[0] == len(prompt) + 8
    np.testing.assert_array_equal(second.routes[:2 * BLOCK], first.routes[:2 * BLOCK])
    cache, engine.prefix_cache = engine.prefix_cache, None
    try:
        (full,) = sample(engine, [prompt], 1, max_new_tokens=8, seeds=[2], **settings)
    finally:
        engine.prefix_cache = cache
    assert second.tokens == full.tokens
    np.testing.assert_array_equal(second.routes, full.routes)
    np.testing.assert_allclose(second.logprobs, full.logprobs, atol=2e-5, rtol=0)


STOP_AT_ONCE = tuple(range(256))  # every byte ends a reply: each model turn is one token, and stops


class ScriptedEnvironment:
    """Answers the first model turn with a tool message, whatever it says, and ends the episode at the second
    with a reward of 1 (the tool round trip of a multi-turn episode, independent of what a random model writes)."""

    tools = []  # none advertised: the prompt stays short (the rows of this module hold 64 tokens)

    def __init__(self):
        self.turns, self.closed = 0, False

    def step(self, messages):
        self.turns += 1
        assert messages[-1]["role"] == "assistant"
        if self.turns == 1:
            return EnvTurn(messages=({"role": "tool", "tool_call_id": "call_0", "content": "50"},))
        return EnvTurn(done=True, reward=1.0)

    def close(self):
        self.closed = True


def test_multi_turn_trains_exactly_the_models_tokens(rollout):
    """Two model turns around a tool turn: the row is prompt, the first reply, the tool message and the next
    generation prompt as the transcript renders them, the second reply; only the replies train, each with its
    sampled log-probabilities; every token has its experts; the environment is closed."""
    from k3jax.rl.episodes import run_episodes
    from k3jax.rl.prompts import PromptRecord

    cfg, graphdef, state, engine, *_ = rollout
    engine.set_weights(nnx.state(nnx.merge(graphdef, state).model))
    tok = load_tokenizer("byte")
    envs = []

    def factory(fields):
        envs.append(ScriptedEnvironment())
        return envs[-1]

    record = PromptRecord(messages=({"role": "user", "content": "?"},), text=None, tools=None, fields={},
                          where="test:0")
    (episode,) = run_episodes(engine, tok, [record], 1, factory, max_turns=3, row_tokens=cfg.train.seq_len + 1,
                              max_new_tokens=4, temperature=1.0, top_p=1.0, stop_ids=STOP_AT_ONCE,
                              seed=lambda r, t: 7 + t)
    assert envs[0].closed and envs[0].turns == 2 and episode.finish == "stop" and episode.env_reward == 1.0
    trained = episode.trained
    tool_turn = tok.encode("\ntool: 50\x04\nassistant:")
    # the untrained tokens are exactly the tool turn and the generation prompt, rendered by the transcript
    untrained = [t for t, m in zip(episode.tokens, trained) if not m]
    assert untrained == tool_turn
    first = trained.tolist().index(False)
    assert all(trained[:first]) and all(trained[first + len(tool_turn):])
    assert len(episode.tokens) - len(tool_turn) == trained.sum() == 2  # one token a reply: every byte stops
    assert np.all(episode.logprobs[~trained] == 0) and np.all(episode.logprobs[trained] < 0)
    assert episode.routes.shape[0] == len(episode.prompt) + len(episode.tokens)
    batch = training_rows([episode], cfg.train.seq_len, cfg.model.moe.top_k, len(moe_layers(cfg.model)))
    assert batch["mask"].sum() == trained.sum()
