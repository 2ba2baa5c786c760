"""Tests of nested.data: shapes, determinism, and the defining property of every task."""

import dataclasses
import math

import numpy as np
import pytest

from nested import data
from nested.data import (
    NEEDLE,
    QUERY,
    CharLMTask,
    ContinualTask,
    MQARTask,
    NIAHTask,
    make_task,
)


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory):
    """Twenty files, file i made of one letter (so a window tells its file), one non-UTF-8."""
    root = tmp_path_factory.mktemp("corpus")
    for i in range(20):
        (root / f"f{i:02d}.txt").write_bytes(bytes([65 + i]) * 300)
    (root / "sub").mkdir()
    (root / "sub" / "latin1.txt").write_bytes("café naïve ".encode("latin-1") * 40 + b"\xff\xfe")
    return root


def small_tasks(corpus_dir):
    return {
        "mqar": MQARTask(
            vocab_size=64,
            train_settings=((16, 2), (32, 4), (32, 8)),
            test_settings=((32, 4), (64, 8)),
            seed=3,
        ),
        "niah": NIAHTask(vocab_size=64, seq_len=24, eval_lengths=(24, 40), seed=3),
        "char_lm": CharLMTask(path=str(corpus_dir), seq_len=32, val_fraction=0.2, seed=3),
        "continual": ContinualTask(
            vocab_size=64, num_keys=8, num_pairs=4, num_queries=3, num_tasks=3, switch_every=5
        ),
    }


TASK_NAMES = ["mqar", "niah", "char_lm", "continual"]


def assert_batches_equal(a, b):
    for x, y in [(a.inputs, b.inputs), (a.targets, b.targets), (a.mask, b.mask)]:
        np.testing.assert_array_equal(x, y)
    assert a.extras.keys() == b.extras.keys()
    for key in a.extras:
        np.testing.assert_array_equal(a.extras[key], b.extras[key])


# ----------------------------------------------------------------------------- protocol


@pytest.mark.parametrize("name", TASK_NAMES)
@pytest.mark.parametrize("split_index", [0, 1])
def test_shapes_dtypes_and_masks(name, split_index, corpus_dir):
    task = small_tasks(corpus_dir)[name]
    split = ("train", *task.eval_splits)[split_index]
    batch = task.batch(7, 5, split=split)
    b, t = batch.inputs.shape
    assert b == 5 and (split != "train" or t == task.seq_len)
    assert batch.inputs.dtype == np.int32 and batch.targets.dtype == np.int32
    assert batch.mask.dtype == np.float32
    assert batch.targets.shape == batch.mask.shape == (b, t)
    assert set(np.unique(batch.mask)) <= {0.0, 1.0} and batch.mask.sum(axis=1).min() >= 1
    assert batch.inputs.min() >= 0 and batch.inputs.max() < task.vocab_size
    assert batch.targets.min() >= 0 and batch.targets.max() < task.vocab_size
    assert (batch.targets[batch.mask == 0] == 0).all() or name == "char_lm"
    for value in batch.extras.values():
        assert value.shape[0] == b


@pytest.mark.parametrize("name", TASK_NAMES)
def test_batch_is_a_function_of_seed_split_and_index(name, corpus_dir):
    task = small_tasks(corpus_dir)[name]
    again = dataclasses.replace(task)  # a fresh instance, as after a restart
    assert_batches_equal(task.batch(11, 4), again.batch(11, 4))
    assert_batches_equal(
        task.batch(11, 4, split=task.eval_splits[0]), again.batch(11, 4, split=task.eval_splits[0])
    )
    reference = task.batch(11, 4)
    for other in [
        task.batch(12, 4),
        dataclasses.replace(task, seed=task.seed + 1).batch(11, 4),
        task.batch(11, 4, split=task.eval_splits[0]),
    ]:
        assert not np.array_equal(other.inputs, reference.inputs)


@pytest.mark.parametrize("name", TASK_NAMES)
def test_resumed_iteration_equals_uninterrupted(name, corpus_dir):
    task = small_tasks(corpus_dir)[name]
    stream = data.iterate(task, batch_size=3)
    uninterrupted = [next(stream) for _ in range(6)]
    resumed = data.iterate(task, batch_size=3, start=4)  # data position saved = next index
    for (i, a), (j, b) in zip(uninterrupted[4:], [next(resumed) for _ in range(2)], strict=True):
        assert i == j
        assert_batches_equal(a, b)


@pytest.mark.parametrize("name", TASK_NAMES)
def test_bad_requests_raise(name, corpus_dir):
    task = small_tasks(corpus_dir)[name]
    with pytest.raises(ValueError, match="split='nope'.*allowed"):
        task.batch(0, 2, split="nope")
    with pytest.raises(ValueError, match="index"):
        task.batch(-1, 2)
    with pytest.raises(ValueError, match="batch_size"):
        task.batch(0, 0)


def test_make_task_and_registry():
    assert set(data.TASKS) == {"mqar", "niah", "char_lm", "continual", "companion", "tokens"}
    task = make_task("mqar", vocab_size=64, train_settings=[[16, 2]], test_settings=[[32, 8]])
    assert task.test_settings == ((32, 8),) and hash(task)
    with pytest.raises(ValueError, match=r"unknown task name='mqra'.*'char_lm'"):
        make_task("mqra")
    with pytest.raises(ValueError, match=r"\['seqlen'\].*'power_a'"):
        make_task("mqar", seqlen=64)


def test_sampling_without_replacement_matches_successive_draws():
    """P(first = i, second = j) = w_i / W * w_j / (W - w_i), as for np.random.choice."""
    w = np.array([1.0, 2.0, 3.0, 4.0])
    draws = data.sample_without_replacement(np.random.default_rng(0), 4, 2, rows=200_000, weights=w)
    assert (draws[:, 0] != draws[:, 1]).all()
    counts = np.zeros((4, 4))
    np.add.at(counts, (draws[:, 0], draws[:, 1]), 1.0)
    expected = w[:, None] / w.sum() * w[None, :] / (w.sum() - w[:, None])
    np.fill_diagonal(expected, 0.0)
    np.testing.assert_allclose(counts / len(draws), expected, atol=4e-3)


# ----------------------------------------------------------------------------- MQAR


def test_mqar_targets_are_the_values_paired_with_earlier_keys():
    task = MQARTask(
        vocab_size=64, train_settings=((16, 2), (32, 4), (32, 8)), test_settings=((32, 8),)
    )
    batch = task.batch(0, 64)
    half = task.vocab_size // 2
    assert set(batch.extras["seq_len"]) == {16, 32}
    for r in range(64):
        length, pairs = batch.extras["seq_len"][r], batch.extras["num_kv_pairs"][r]
        x, y, m = batch.inputs[r], batch.targets[r], batch.mask[r]
        keys, values = x[0 : 2 * pairs : 2], x[1 : 2 * pairs : 2]
        assert ((keys >= 1) & (keys < half)).all() and len(set(keys)) == pairs
        assert ((values >= half) & (values < 64)).all() and len(set(values)) == pairs
        queries = np.flatnonzero(m)
        assert len(queries) == pairs  # one query per key
        assert (queries >= 2 * pairs).all() and (queries < length).all()
        assert ((queries - 2 * pairs) % 2 == 0).all()  # query slots at even offsets
        assert sorted(x[queries]) == sorted(keys)  # every key queried once
        paired = dict(zip(keys.tolist(), values.tolist(), strict=True))
        assert all(y[t] == paired[x[t]] for t in queries)
        assert (x[length:] == 0).all() and (m[length:] == 0).all()  # right padding


def test_mqar_filler_and_test_split_per_setting():
    inputs, targets, mask = data.mqar_sequences(
        np.random.default_rng(0),
        8,
        vocab_size=64,
        seq_len=40,
        num_kv_pairs=5,
        power_a=0.5,
        random_non_queries=False,
    )
    filler = np.ones_like(mask, dtype=bool)
    filler[:, :10] = False
    filler[mask > 0] = False
    assert (inputs[filler] == 0).all() and (targets[filler] == 0).all()
    task = MQARTask(vocab_size=64, train_settings=((16, 2),), test_settings=((32, 4), (64, 16)))
    assert task.eval_splits == ("seq32_kv4", "seq64_kv16")
    batch = task.batch(2, 3, split="seq64_kv16")
    assert batch.inputs.shape == (3, 64) and (batch.mask.sum(axis=1) == 16).all()
    assert (batch.extras["num_kv_pairs"] == 16).all()


def test_mqar_power_law_puts_queries_near_the_pairs():
    def mean_gap(power_a):
        *_, mask = data.mqar_sequences(
            np.random.default_rng(1),
            2000,
            vocab_size=256,
            seq_len=136,
            num_kv_pairs=4,
            power_a=power_a,
        )
        return (np.flatnonzero(mask.ravel()) % 136 - 8).mean() / 2

    # uniform (a = 1) over 64 slots: E[slot] = 31.5; a = 0.01 concentrates near slot 0
    assert abs(mean_gap(1.0) - 31.5) < 0.5
    assert mean_gap(0.01) < 15.0


def test_mqar_mixture_weights():
    task = MQARTask(
        vocab_size=64,
        train_settings=((16, 2), (32, 4)),
        test_settings=((32, 4),),
        train_weights=(3.0, 1.0),
    )
    share = (task.batch(0, 4000).extras["seq_len"] == 16).mean()
    assert abs(share - 0.75) < 0.03
    only_first = dataclasses.replace(task, train_weights=(1.0, 0.0))
    assert (only_first.batch(1, 50).extras["seq_len"] == 16).all()


@pytest.mark.parametrize(
    "fields, match",
    [
        (dict(train_settings=((15, 4),)), r"train_settings.seq_len=15.*16 <= seq_len"),
        (dict(test_settings=((64, 0),)), r"test_settings.num_kv_pairs=0"),
        (dict(vocab_size=16, train_settings=((64, 8),)), r"vocab_size=16.*vocab_size >= 18"),
        (dict(power_a=0.0), r"power_a=0.0"),
        (dict(train_weights=(1.0,)), r"train_weights=\(1.0,\).*5 non-negative"),
        (dict(test_settings=((64, 4), (64, 4))), r"test_settings.*duplicates"),
        (dict(train_settings=()), r"train_settings=\(\).*at least one"),
    ],
)
def test_mqar_validation(fields, match):
    with pytest.raises(ValueError, match=match):
        MQARTask(**fields)


# ----------------------------------------------------------------------------- NIAH


@pytest.mark.parametrize("distractors", [0, 2])
def test_niah_answer_is_recoverable_from_the_haystack(distractors):
    task = NIAHTask(vocab_size=64, seq_len=48, eval_lengths=(48, 96), num_distractors=distractors)
    m, n = task.key_len, task.value_len
    batch = task.batch(5, 32, split="len96")
    assert batch.inputs.shape == (32, 96)
    for r in range(32):
        x, y, mask = batch.inputs[r], batch.targets[r], batch.mask[r]
        needles = np.flatnonzero(x == NEEDLE)
        assert len(needles) == 1 + distractors and (x == QUERY).sum() == 1
        query = np.flatnonzero(x == QUERY)[0]
        asked = tuple(x[query + 1 : query + 1 + m])
        needle_keys = [tuple(x[p + 1 : p + 1 + m]) for p in needles]
        assert len(set(needle_keys)) == len(needles)  # keys identify needles
        hit = needles[needle_keys.index(asked)]
        answer = x[hit + 1 + m : hit + 1 + m + n]
        np.testing.assert_array_equal(y[mask > 0], answer)
        assert np.flatnonzero(mask).tolist() == list(range(96 - n, 96))
        assert batch.extras["needle_pos"][r] == hit
        assert (x[query + 1 + m :] == answer[:-1]).all()  # teacher forcing inside the answer


def test_niah_depth_is_uniform():
    depth = NIAHTask(vocab_size=64, seq_len=64, eval_lengths=(64,)).batch(0, 4000).extras["depth"]
    assert depth.min() >= 0.0 and depth.max() <= 1.0
    assert abs(depth.mean() - 0.5) < 0.02 and abs((depth < 0.25).mean() - 0.25) < 0.03


@pytest.mark.parametrize(
    "fields, match",
    [
        (dict(seq_len=9), r"seq_len=9.*length >= 10"),
        (dict(eval_lengths=(64, 8)), r"eval_lengths=8.*length >= 10"),
        (dict(vocab_size=6), r"vocab_size=6.*vocab_size >= 7"),
        (dict(key_len=0), r"key_len=0"),
    ],
)
def test_niah_validation(fields, match):
    with pytest.raises(ValueError, match=match):
        NIAHTask(**fields)


# ----------------------------------------------------------------------------- char LM


def test_char_lm_targets_are_inputs_shifted_and_windows_come_from_their_split(corpus_dir):
    task = small_tasks(corpus_dir)["char_lm"]
    for split in ("train", "val"):
        batch = task.batch(0, 16, split=split)
        np.testing.assert_array_equal(batch.inputs[:, 1:], batch.targets[:, :-1])
        assert (batch.mask == 1).all()
        text = task.split_bytes(split).tobytes()
        for x, y in zip(batch.inputs, batch.targets, strict=True):
            assert bytes(np.append(x, y[-1]).astype(np.uint8)) in text


def test_char_lm_train_and_val_files_are_disjoint(corpus_dir):
    task = small_tasks(corpus_dir)["char_lm"]
    train, val = set(task.split_files("train")), set(task.split_files("val"))
    assert train and val and not train & val
    assert train | val == {f"f{i:02d}.txt" for i in range(20)} | {"sub/latin1.txt"}
    # letters of held-out files never appear in training windows, and vice versa
    held = {65 + int(f[1:3]) for f in val if f.startswith("f")}
    seen = np.unique(task.batch(0, 64).inputs)
    assert not held & set(seen.tolist())
    # the split rule is per file: adding a file moves no other file
    more = data.split_files([*train, *val, "new.txt"], 0.2)
    assert set(more[1]) - {"new.txt"} == val


def test_char_lm_reads_non_utf8_bytes(corpus_dir):
    task = dataclasses.replace(
        small_tasks(corpus_dir)["char_lm"], path=str(corpus_dir / "sub"), glob="*.txt"
    )
    with pytest.raises(ValueError, match="1 file.*at least 2"):
        task.batch(0, 2)
    single = CharLMTask(path=str(corpus_dir / "sub" / "latin1.txt"), seq_len=64, val_fraction=0.3)
    raw = (corpus_dir / "sub" / "latin1.txt").read_bytes()
    split_sizes = len(single.split_bytes("train")), len(single.split_bytes("val"))
    assert split_sizes == (len(raw) - math.ceil(0.3 * len(raw)), math.ceil(0.3 * len(raw)))
    seen = np.concatenate([single.batch(i, 8).inputs.ravel() for i in range(4)])
    assert seen.max() >= 0xE9  # the Latin-1 byte of 'é' is a token, not an error
    assert "latin1.txt, its last 30% of bytes held out as 'val';" in single.describe()
    assert "\ufffd" in data.decode(np.array([0xE9, 0x20]))


def test_char_lm_tiny_or_empty_corpus_raises(tmp_path):
    tiny = tmp_path / "tiny.txt"
    tiny.write_bytes(b"x" * 40)
    with pytest.raises(ValueError, match=r"tiny.txt.*seq_len \+ 1 = 65"):
        CharLMTask(path=str(tiny), seq_len=64).batch(0, 1)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"empty.*0 file"):
        CharLMTask(path=str(tmp_path / "empty")).batch(0, 1)
    with pytest.raises(ValueError, match="missing' does not exist; give a text file or a"):
        CharLMTask(path=str(tmp_path / "missing")).batch(0, 1)
    with pytest.raises(ValueError, match="val_fraction=1.0"):
        CharLMTask(val_fraction=1.0)


def test_char_lm_default_corpus_is_the_stdlib():
    task = CharLMTask(seq_len=64)
    train, val = set(task.split_files("train")), set(task.split_files("val"))
    assert "os.py" in train | val and not train & val
    assert 0.02 < len(val) / (len(train) + len(val)) < 0.08
    assert not any("site-packages" in f for f in train)
    assert task.batch(0, 2, split="val").inputs.shape == (2, 64)


def test_bits_per_char():
    assert data.bits_per_char(math.log(2.0)) == pytest.approx(1.0)
    assert data.bits_per_char(math.log(256.0)) == pytest.approx(8.0)  # uniform over bytes


# ----------------------------------------------------------------------------- continual


def assert_follows(batch, task, task_id):
    """Row r's presented pairs are (k, f^r(k)) and every scored query q of row r has target
    f^r(q), fed right after it, with f^r = task.mapping(task_id, r)."""
    rows, times = np.nonzero(batch.mask)
    assert rows.size == batch.inputs.shape[0] * task.num_queries
    first = task.keys(task_id)[0]
    for r, t in zip(rows, times, strict=True):
        key = batch.inputs[r, t]
        value = task.mapping(task_id, r)[key - first]
        assert batch.targets[r, t] == value == batch.inputs[r, t + 1]
    pairs = batch.inputs[:, : 2 * task.num_pairs]
    assert np.isin(batch.inputs[:, 0::2], task.keys(task_id)).all()
    for r in range(batch.inputs.shape[0]):
        f = task.mapping(task_id, r)
        np.testing.assert_array_equal(pairs[r, 1::2], f[pairs[r, 0::2] - first])


def small_continual(**fields):
    base = dict(vocab_size=64, num_keys=8, num_pairs=4, num_queries=3, num_tasks=3)
    return ContinualTask(**{**base, "switch_every": 5, **fields})


def test_continual_mapping_changes_at_task_boundaries():
    task = small_continual()
    for row in range(4):
        maps = [task.mapping(j, row) for j in range(3)]
        for j in range(1, 3):
            assert (maps[j] != maps[j - 1]).all()  # remap_fraction = 1: every key moves
            assert len(set(maps[j])) == 8 and (maps[j] >= 32).all() and (maps[j] < 64).all()
    assert [task.task_at(i) for i in (0, 4, 5, 9, 10, 15)] == [0, 0, 1, 1, 2, 0]
    assert_follows(task.batch(4, 16), task, 0)
    boundary = task.batch(5, 16)
    assert (boundary.extras["task_id"] == 1).all()
    assert_follows(boundary, task, 1)
    with pytest.raises(AssertionError):
        assert_follows(boundary, task, 0)


def test_continual_disjoint_keys_give_every_task_keys_of_its_own():
    """With disjoint_keys task j asks keys 1 + jK .. (j + 1)K under a one-to-one map of its
    own; the batches follow it, and the vocabulary and remap checks name their fields."""
    task = small_continual(disjoint_keys=True, vocab_size=64)  # 3 x 8 keys < 32
    np.testing.assert_array_equal(task.keys(2), np.arange(17, 25))
    for row in range(3):
        maps = [task.mapping(j, row) for j in range(3)]
        for f in maps:
            assert len(set(f.tolist())) == 8 and (f >= 32).all() and (f < 64).all()
        assert not np.array_equal(maps[0], maps[1])
    for index, task_id in ((0, 0), (5, 1), (12, 2)):
        assert_follows(task.batch(index, 8), task, task_id)
    assert_follows(task.batch(3, 8, split="task1"), task, 1)
    assert "each task its own keys" in task.describe()
    with pytest.raises(ValueError, match="vocab_size.*3 tasks of 8 keys.*>= 50"):
        small_continual(disjoint_keys=True, vocab_size=48)
    with pytest.raises(ValueError, match="remap_fraction.*leave it 1.0"):
        small_continual(disjoint_keys=True, remap_fraction=0.5)


def test_continual_review_queries_ask_the_earlier_tasks_of_the_rows_agent():
    """With review_queries=2 the last two queries of a training batch ask keys of the tasks
    the row's agent met earlier, answered by their maps and never in context; the first
    phase and the eval splits have none, and the rest of the batch is the one without."""
    task = small_continual(disjoint_keys=True, review_queries=2, agent_every=15)
    plain = small_continual(disjoint_keys=True, agent_every=15)
    assert [task.earlier(i) for i in (0, 4, 5, 12, 15, 20)] == [[], [], [0], [0, 1], [], [0]]
    np.testing.assert_array_equal(task.batch(3, 8).inputs, plain.batch(3, 8).inputs)
    np.testing.assert_array_equal(
        task.batch(12, 8, split="task1").inputs, plain.batch(12, 8, split="task1").inputs
    )
    batch, same = task.batch(12, 8), plain.batch(12, 8)  # task 2 of agent 0, after tasks 0, 1
    p, q = task.num_pairs, task.num_queries
    own = slice(0, 2 * (p + q - 2))
    np.testing.assert_array_equal(batch.inputs[:, own], same.inputs[:, own])
    review = batch.inputs[:, 2 * (p + q - 2) :: 2]  # (rows, 2) keys
    assert np.isin(review, np.concatenate([task.keys(0), task.keys(1)])).all()
    for r in range(8):
        assert len(set(review[r].tolist())) == 2
        for t, key in zip(range(2 * (p + q - 2), task.seq_len, 2), review[r], strict=True):
            owner = (key - 1) // task.num_keys
            value = task.mapping(owner, r, agent=0)[(key - 1) % task.num_keys]
            assert batch.targets[r, t] == value == batch.inputs[r, t + 1]
            assert batch.extras["in_context"][r, t] == 0 and batch.mask[r, t] == 1
    with pytest.raises(ValueError, match="review_queries.*set disjoint_keys=True"):
        small_continual(review_queries=1)
    with pytest.raises(ValueError, match="review_queries.*num_queries"):
        small_continual(disjoint_keys=True, review_queries=4)


def test_continual_earlier_task_eval_uses_the_old_mapping():
    task = small_continual()
    for index in (0, 12, 1000):
        old = task.batch(index, 16, split="task0")
        assert (old.extras["task_id"] == 0).all()
        assert_follows(old, task, 0)


def test_continual_rows_have_their_own_mappings():
    task = ContinualTask()  # default sizes: 64 keys, values in [4096, 8192)
    maps = np.stack([task.mapping(0, r) for r in range(32)])
    # two random one-to-one maps into 4096 values agree on ~64/4096 keys each: almost never
    for a in range(32):
        for b in range(a):
            assert (maps[a] != maps[b]).sum() >= 60
    # so no single map (what a slow weight could memorise) fits the rows of a batch: key 1
    # takes (nearly) as many values as there are rows
    assert len(set(maps[:, 0].tolist())) >= 30
    batch = task.batch(3, 32)
    assert_follows(batch, task, 0)
    shifted = batch._replace(inputs=batch.inputs[::-1], targets=batch.targets[::-1])
    with pytest.raises(AssertionError):
        assert_follows(shifted, task, 0)


def test_continual_row_mapping_does_not_depend_on_batch_size_or_index():
    task = small_continual()
    cold = small_continual()  # nothing cached: mapping() draws row 3's chain on its own
    expected = [cold.mapping(j, 3) for j in range(3)]
    for index, size in [(0, 4), (7, 16), (12, 4), (1000, 16)]:
        batch = task.batch(index, size)
        j = task.task_at(index)
        np.testing.assert_array_equal(task.mapping(j, 3), expected[j])
        f = expected[j]
        keys = batch.inputs[3, 0::2]
        np.testing.assert_array_equal(batch.inputs[3, 1::2], f[keys - 1])
    eval_batch = task.batch(5, 4, split="task2")
    np.testing.assert_array_equal(
        eval_batch.inputs[3, 1::2], expected[2][eval_batch.inputs[3, 0::2] - 1]
    )
    # another seed gives another chain
    assert (small_continual(seed=1).mapping(0, 3) != expected[0]).any()


@pytest.mark.parametrize(("fraction", "moved"), [(1.0, 40), (0.25, 10), (0.5, 20), (0.001, 1)])
def test_continual_remap_moves_the_fraction_of_keys_to_unused_values(fraction, moved):
    task = ContinualTask(vocab_size=256, num_keys=40, num_tasks=3, remap_fraction=fraction)
    for row in (0, 1, 5):
        for j in (1, 2):
            prev, new = task.mapping(j - 1, row), task.mapping(j, row)
            changed = prev != new
            assert changed.sum() == moved
            assert not set(new[changed].tolist()) & set(prev.tolist())  # to unused values
            assert len(set(new.tolist())) == 40 and (new >= 128).all() and (new < 256).all()


def test_continual_in_context_flags():
    task = ContinualTask(vocab_size=256, num_keys=40, num_tasks=2, remap_fraction=0.25)
    batch = task.batch(0, 8)
    p = task.num_pairs
    for r in range(8):
        presented = set(batch.inputs[r, 0 : 2 * p : 2].tolist())
        for t in np.flatnonzero(batch.mask[r]):
            assert batch.extras["in_context"][r, t] == (batch.inputs[r, t] in presented)
    assert (batch.extras["in_context"] <= batch.mask).all()
    # both kinds of query occur: 16 of 40 keys presented, 16 queried
    assert 0 < batch.extras["in_context"].sum() < batch.mask.sum()


@pytest.mark.parametrize(
    ("task_id", "row", "match"), [(3, 0, "task_id=3"), (-1, 0, "task_id=-1"), (0, -1, "row=-1")]
)
def test_continual_mapping_validation(task_id, row, match):
    with pytest.raises(ValueError, match=match):
        small_continual().mapping(task_id, row)


@pytest.mark.parametrize(
    "fields, match",
    [
        (dict(num_keys=8, num_pairs=9), r"num_keys=8.*max\(num_pairs, num_queries\)"),
        (dict(vocab_size=100), r"vocab_size=100.*vocab_size >= 256"),
        (dict(remap_fraction=0.0), r"remap_fraction=0.0"),
        (dict(switch_every=0), r"switch_every=0"),
    ],
)
def test_continual_validation(fields, match):
    with pytest.raises(ValueError, match=match):
        ContinualTask(**fields)


@pytest.mark.parametrize("name", TASK_NAMES)
def test_describe_shows_an_example(name, corpus_dir):
    text = small_tasks(corpus_dir)[name].describe()
    assert "xample" in text and len(text.splitlines()) >= 2
