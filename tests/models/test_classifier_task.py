"""The shipped classification task: deterministic disjoint splits, a cached pretrained backbone,
fine-tuning that learns, and an accuracy that counts right."""
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zerojax as zj
from zerojax.models import classifier, gpt

# the task's data and training recipe live with examples/finetune_classifier.py, which imports them by name
EXAMPLES = str(pathlib.Path(__file__).resolve().parents[2] / "examples")
if EXAMPLES not in sys.path:
    sys.path.insert(0, EXAMPLES)
import classifier_data  # noqa: E402
import classifier_training  # noqa: E402

TINY = classifier.model_config(d_model=32, n_layer=1)


@pytest.fixture(scope="module")
def task():
    return classifier_data.load_task()


def rows(data):
    return {(tuple(t[:n]), int(y)) for t, n, y in zip(data["tokens"], data["length"], data["label"])}


def test_task_is_deterministic_balanced_and_disjoint(task):
    train, heldout, num_classes, vocab = task
    classifier_data.vocabulary.cache_clear()
    again = classifier_data.load_task()
    for a, b in zip((train, heldout), again[:2]):
        assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    assert again[2:] == (num_classes, vocab) and len(vocab) == classifier.VOCAB
    assert num_classes == len(classifier_data.PACKAGES)
    # balanced classes, a quarter held out, and no paragraph (as the model sees it) in both splits
    assert np.bincount(train["label"]).tolist() == [len(train["label"]) // num_classes] * num_classes
    assert np.bincount(heldout["label"]).tolist() == [len(heldout["label"]) // num_classes] * num_classes
    assert len(heldout["label"]) == pytest.approx(len(train["label"]) / 3, rel=0.02)
    assert not {t for t, _ in rows(train)} & {t for t, _ in rows(heldout)}
    assert len(rows(train)) == len(train["label"]) and len(rows(heldout)) == len(heldout["label"])
    # tokens are the paragraph's ids, then padding
    for data in (train, heldout):
        positions = np.arange(data["tokens"].shape[1])[None, :]
        real = positions < data["length"][:, None]
        pad = classifier_data.PAD
        assert (data["tokens"][~real] == pad).all() and (data["tokens"][real] != pad).all()
        assert data["length"].min() >= 1 and data["tokens"].max() < len(vocab)
    assert classifier_data.encode("The event loop", vocab) == [vocab.index(w) for w in ("the", "event", "loop")]


def test_accuracy_counts_a_hand_made_case():
    backbone = gpt.init_params(TINY, jax.random.PRNGKey(0))
    params = classifier.init_classifier(backbone, 4, jax.random.PRNGKey(1))
    params["head"] = {"kernel": jnp.zeros_like(params["head"]["kernel"]), "bias": jnp.array([0.0, 0.0, 5.0, 0.0])}
    data = {"tokens": np.ones((5, TINY.seq_len), np.int32), "length": np.array([3, 1, 7, 2, 48], np.int32),
            "label": np.array([2, 0, 2, 1, 2], np.int32)}
    assert classifier.accuracy(params, data) == pytest.approx(0.6)
    assert classifier.accuracy(params, data, batch_size=2) == pytest.approx(0.6)  # a padded last chunk
    # with a real head, predictions are the argmax of the logits, whatever the chunking
    params = classifier.init_classifier(backbone, 4, jax.random.PRNGKey(1))
    params["head"]["kernel"] = params["head"]["kernel"] * 500
    data["tokens"] = np.random.default_rng(0).integers(3, 100, data["tokens"].shape).astype(np.int32)
    want = np.argmax(np.asarray(jax.jit(classifier.logits)(params, data)), axis=-1)
    assert len(set(want.tolist())) > 1
    assert np.array_equal(classifier.predict(params, data, batch_size=2), want)
    data["label"] = want
    assert classifier.accuracy(params, data) == 1.0


def test_pretrained_backbone_is_cached(tmp_path):
    first = classifier_training.pretrained_params(str(tmp_path), TINY, steps=3)
    files = list(tmp_path.iterdir())
    assert len(files) == 1 and files[0].suffix == ".npz"
    again = classifier_training.pretrained_params(str(tmp_path), TINY, steps=3)
    assert jax.tree_util.tree_structure(first) == jax.tree_util.tree_structure(again)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree_util.tree_leaves(first), jax.tree_util.tree_leaves(again)))
    fresh = gpt.init_params(TINY, jax.random.PRNGKey(0))
    assert not np.array_equal(first["wte"], fresh["wte"])  # it trained
    assert classifier.config_of(first) == TINY


def test_a_few_fine_tuning_steps_reduce_the_loss(task):
    train = {k: v[:64] for k, v in task[0].items()}
    params = classifier.init_classifier(gpt.init_params(TINY, jax.random.PRNGKey(0)), task[2], jax.random.PRNGKey(0))
    before = float(jax.jit(classifier.loss_fn)(params, train))
    state, losses, _ = classifier_training.finetune(params, train, optax.adam(3e-3), mesh=zj.make_mesh(),
                                           config=zj.ZeroConfig(stage=2), epochs=2, batch_size=16)
    after = float(jax.jit(classifier.loss_fn)(state.full_params(), train))
    assert len(losses) == 8
    assert after < 0.8 * before, (before, after)
