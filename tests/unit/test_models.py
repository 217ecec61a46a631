"""Built-in models and datasets (elastic.models): shapes, causality, slicing, data, training."""

from __future__ import annotations

import functools
import pickle

import pytest
import torch

from elastic import models as m

torch.set_num_threads(1)

SMALL = {"block_size": 32, "n_layer": 2, "n_head": 2, "n_embd": 32}


@pytest.fixture(scope="module")
def demo() -> m.CharDataset:
    return m.demo_dataset(block_size=32)


def _small_gpt(vocab_size: int, seed: int = 0) -> m.TinyGPT:
    torch.manual_seed(seed)
    return m.gpt(vocab_size=vocab_size, **SMALL)


# ---- MLP and regression data -----------------------------------------------------------------


def test_tiny_mlp_shapes_and_determinism():
    torch.manual_seed(1)
    a = m.tiny_mlp()
    torch.manual_seed(1)
    b = m.tiny_mlp()
    assert isinstance(a, torch.nn.Sequential) and len(a) == 3
    assert all(any(True for _ in child.parameters()) for child in a)
    for (ka, va), (kb, vb) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert ka == kb and torch.equal(va, vb)
    x = torch.randn(5, 16)
    assert a(x).shape == (5, 4)
    assert torch.allclose(a[1:](a[:1](x)), a(x))
    assert len(m.tiny_mlp(8, 8, 2, depth=5)) == 5
    with pytest.raises(ValueError):
        m.tiny_mlp(depth=0)


def test_synthetic_regression():
    ds = m.SyntheticRegression()
    ds2 = m.SyntheticRegression()
    assert len(ds) == 1024
    x, y = ds[3]
    assert x.shape == (16,) and y.shape == (4,) and x.dtype == torch.float32
    assert torch.equal(ds.x, ds2.x) and torch.equal(ds.y, ds2.y)
    assert not torch.equal(ds.x, m.SyntheticRegression(seed=1).x)
    idx = torch.tensor([5, 0, 1023, 5])
    bx, by = ds.get_batch(idx)
    assert torch.equal(bx, torch.stack([ds[int(i)][0] for i in idx]))
    assert torch.equal(by, torch.stack([ds[int(i)][1] for i in idx]))
    with pytest.raises(IndexError):
        ds[1024]
    torch.manual_seed(0)
    model = m.tiny_mlp()
    assert m.mlp_loss(model(bx), by).ndim == 0


# ---- GPT ---------------------------------------------------------------------------------------


def test_gpt_layout_and_shapes():
    model = _small_gpt(50)
    assert isinstance(model, torch.nn.Sequential)
    assert len(model) == SMALL["n_layer"] + 2
    assert isinstance(model[0], m.Embedding) and isinstance(model[-1], m.LMHead)
    x = torch.randint(0, 50, (3, 20))
    logits = model(x)
    assert logits.shape == (3, 20, 50)
    y = torch.randint(0, 50, (3, 20))
    loss = m.gpt_loss(logits, y)
    ref = torch.nn.functional.cross_entropy(logits.reshape(60, 50), y.reshape(60))
    assert loss.ndim == 0 and torch.allclose(loss, ref)
    with pytest.raises(ValueError):
        model(torch.zeros(1, SMALL["block_size"] + 1, dtype=torch.long))


def test_gpt_deterministic_init_and_default_vocab():
    a, b = _small_gpt(40, seed=3), _small_gpt(40, seed=3)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    assert m.gpt(**SMALL)[0].tok.num_embeddings == m.demo_dataset().vocab_size


def test_gpt_is_causal():
    model = _small_gpt(30).eval()
    x = torch.randint(0, 30, (2, 16))
    x2 = x.clone()
    x2[:, 10] = (x2[:, 10] + 1) % 30
    with torch.no_grad():
        a, b = model(x), model(x2)
    assert torch.allclose(a[:, :10], b[:, :10], atol=1e-6)
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_gpt_slices_compose_and_keep_names():
    model = _small_gpt(30)
    x = torch.randint(0, 30, (2, 12))
    with torch.no_grad():
        whole = model(x)
        head, tail = model[0:2], model[2:]
        assert type(head) is torch.nn.Sequential
        assert torch.allclose(tail(head(x)), whole, atol=1e-6)
        # every split point gives valid stages
        for k in range(1, len(model)):
            assert torch.allclose(model[k:](model[:k](x)), whole, atol=1e-6)
    full_names = {n for n, _ in model.named_parameters()}
    stage_names = {n for n, _ in head.named_parameters()} | {n for n, _ in tail.named_parameters()}
    assert stage_names == full_names


def test_factories_pickle():
    factory = functools.partial(m.gpt, vocab_size=20, **SMALL)
    torch.manual_seed(0)
    a = pickle.loads(pickle.dumps(factory))()
    torch.manual_seed(0)
    b = factory()
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    model = pickle.loads(pickle.dumps(b))
    x = torch.randint(0, 20, (1, 8))
    assert torch.equal(model(x), b(x))
    for obj in (m.gpt_loss, m.mlp_loss, m.tiny_mlp, m.SyntheticRegression()):
        pickle.loads(pickle.dumps(obj))


# ---- character data ------------------------------------------------------------------------------


def test_char_dataset_items_and_batch():
    text = "hello world, hello elastic\n" * 3
    ds = m.CharDataset(text, block_size=8)
    assert ds.vocab == tuple(sorted(set(text)))
    assert len(ds) == len(text) - 8
    assert ds.decode(ds.encode(text)) == text
    x, y = ds[4]
    assert x.dtype == torch.long and x.shape == (8,)
    assert ds.decode(x) == text[4:12] and ds.decode(y) == text[5:13]
    x_last, y_last = ds[len(ds) - 1]
    assert ds.decode(y_last) == text[-8:]
    idx = torch.tensor([0, 7, len(ds) - 1, 7])
    bx, by = ds.get_batch(idx)
    assert torch.equal(bx, torch.stack([ds[int(i)][0] for i in idx]))
    assert torch.equal(by, torch.stack([ds[int(i)][1] for i in idx]))
    assert bx.is_contiguous() and by.is_contiguous()
    with pytest.raises(IndexError):
        ds[len(ds)]
    with pytest.raises(ValueError):
        ds.encode("~")


def test_demo_dataset(demo):
    again = m.demo_dataset(block_size=32)
    assert torch.equal(demo.tokens, again.tokens) and demo.vocab == again.vocab
    assert 40_000 <= len(m.demo_text()) <= 80_000
    assert len(demo) == len(m.demo_text()) - 32
    assert all(c == "\n" or " " <= c <= "~" for c in demo.vocab)
    assert "Shall I compare thee to a summer's day?" in m.demo_text()
    clone = pickle.loads(pickle.dumps(demo))
    assert torch.equal(clone.get_batch(torch.arange(5))[0], demo.get_batch(torch.arange(5))[0])


# ---- training and sampling -----------------------------------------------------------------------


def test_gpt_training_lowers_loss(demo):
    model = _small_gpt(demo.vocab_size)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(30):
        x, y = demo.get_batch(torch.randint(0, len(demo), (16,), generator=gen))
        opt.zero_grad(set_to_none=True)
        loss = m.gpt_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert first > 4.0  # about ln(vocab) at init
    assert last < first - 0.8, losses


def test_generate(demo):
    model = _small_gpt(demo.vocab_size)
    model.train()
    out = m.generate(model, demo, "To be", max_new_tokens=40, seed=1)
    assert isinstance(out, str) and len(out) == 5 + 40 and out.startswith("To be")
    assert set(out) <= set(demo.vocab)
    assert model.training  # mode restored
    assert out == m.generate(model, demo, "To be", max_new_tokens=40, seed=1)
    greedy = m.generate(model, demo, "x" * 50, max_new_tokens=3, temperature=0)
    assert len(greedy) == 53  # prompt longer than block_size is cropped, not rejected
    with pytest.raises(ValueError):
        m.generate(model, demo, "")


def test_demo_dataset_splits_hold_out_the_corpus_end():
    train, held = m.demo_dataset(block_size=32, split="train"), m.demo_dataset(32, split="eval")
    whole = m.demo_dataset(block_size=32)
    assert train.vocab == held.vocab == whole.vocab  # one vocabulary: the model fits all three
    assert train.text + held.text == whole.text
    assert abs(len(held.text) / len(whole.text) - m.DEMO_EVAL_FRACTION) < 1e-3
    with pytest.raises(ValueError, match="split"):
        m.demo_dataset(split="test")


def test_a_model_built_for_a_load_keeps_the_tensors_it_shares() -> None:
    """``build_model_for_load`` (a switch, a resize, a resume) materializes a meta-device
    model with ``to_empty``, which gives every module its own copy. Was: a tied weight came
    out as two parameters, and the job trained another model from then on (a user's
    language model, its head tied to its embedding)."""
    from elastic.reference import build_model, build_model_for_load
    from tests.helpers import TiedMlp

    for model in (build_model(TiedMlp, 0), build_model_for_load(TiedMlp, 0)):
        assert model.again.weight is model.mid.weight
        assert len(list(model.parameters())) == 7  # 4 biases, 3 distinct weights


def test_each_rank_draws_its_own_dropout_masks_and_rank_0_one_process_s():
    """After the seeded build, rank 0's generator goes on as a single process's (a 1-worker
    job's dropout is the reference's) and every other rank's from a seed of its own. Was:
    the same stream on every rank: ranks of equal shares drew the same mask for their i-th
    samples (found by review, session 44)."""
    import torch
    from torch import nn

    from elastic.reference import build_model

    def factory() -> nn.Module:
        return nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5))

    x = torch.ones(8, 4)
    masks = []
    for rank in (0, 1, 2, 1):
        model = build_model(factory, 7, rank)
        masks.append(model(x) == 0)
    torch.manual_seed(7)
    one = factory()
    assert torch.equal(masks[0], one(x) == 0)  # rank 0: one process's stream
    assert not torch.equal(masks[0], masks[1]) and not torch.equal(masks[1], masks[2])
    assert torch.equal(masks[1], masks[3])  # a rank's own stream is the same each build
