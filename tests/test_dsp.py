"""bngrad.dsp: the DSP library's BatchNormGrad (seed 004) against bngrad.reference.

Covers the seed's two C examples, every dtype combination of fp_/hp_, train and eval, flat and
(batch, channel) buffers, in-place dx, core_mask -> threads and determinism, and every bad
argument the C library cannot catch (each must raise before anything is written).
"""

from __future__ import annotations

import os

import ml_dtypes
import numpy as np
from numpy.lib.stride_tricks import as_strided
import pytest
from tolerances import assert_close, backward_scales

from bngrad import dsp, reference
from bngrad.errors import ArgumentTypeError, ArgumentValueError

F16, F32, F64 = np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64)
FUNCTIONS = {
    "fp_s": (dsp.fp_batch_norm_grad_s, False),
    "fp_p": (dsp.fp_batch_norm_grad_p, False),
    "hp_s": (dsp.hp_batch_norm_grad_s, True),
    "hp_p": (dsp.hp_batch_norm_grad_p, True),
}
SENTINEL = -7.0  # output buffers start with it, so "nothing written" is visible


def make_buffers(batch, channel, *, half=False, param_dtypes=None, train=True, seed=0,
                 flat=True, extra=0):
    """Flat (or 2-D) x, dy, dx and per-channel buffers, like the seed's C examples.

    ``param_dtypes``: dtype of each of mean, invar, scale, dbias, dscale (default: data's).
    ``extra``: buffers longer than needed by this many elements (the tail must stay untouched).
    """
    rng = np.random.default_rng(seed)
    data_t = F16 if half else F32
    pd = dict(zip(("mean", "invar", "scale", "dbias", "dscale"),
                  param_dtypes or (data_t,) * 5))
    x64 = rng.standard_normal((batch, channel)) * rng.uniform(0.5, 2, channel) + rng.uniform(
        -1, 1, channel)
    x = x64.astype(data_t)
    dy = rng.standard_normal((batch, channel)).astype(data_t)
    mean, var = reference.batch_norm_moments(x)
    if not train:  # running statistics: near the batch's, not equal
        mean = mean + 0.1 * rng.standard_normal(channel)
        var = var * rng.uniform(0.8, 1.25, channel)
    invar = 1.0 / np.sqrt(var + 1e-5)
    scale = rng.uniform(0.5, 1.5, channel) * rng.choice([-1.0, 1.0], channel)

    def data(a):
        a = np.concatenate([a.reshape(-1), np.full(extra, SENTINEL, a.dtype)])
        return a if flat else a.reshape(batch, channel)

    def per_channel(a, name):
        return np.concatenate([np.asarray(a, F64), np.full(extra, SENTINEL)]).astype(pd[name])

    return {
        "x": data(x), "dy": data(dy), "dx": data(np.full((batch, channel), SENTINEL, data_t)),
        "mean": per_channel(mean, "mean"), "invar": per_channel(invar, "invar"),
        "scale": per_channel(scale, "scale"),
        "dbias": per_channel(np.full(channel, SENTINEL), "dbias"),
        "dscale": per_channel(np.full(channel, SENTINEL), "dscale"),
        "batch": batch, "channel": channel, "is_train": int(train),
    }


def params_of(b):
    """The C layout: long long params[12], reserved entries 0."""
    return [b["mean"], b["invar"], b["scale"], b["dbias"], b["dscale"],
            b["batch"], b["channel"], b["is_train"], 0, 0, 0, 0]


def inputs_2d(b):
    """(x, dy, mean, invar, scale) as the C library reads them: prefixes, (batch, channel)."""
    n, c = b["batch"] * b["channel"], b["channel"]
    shape = (b["batch"], c)
    return (b["x"].reshape(-1)[:n].reshape(shape), b["dy"].reshape(-1)[:n].reshape(shape),
            b["mean"][:c], b["invar"][:c], b["scale"][:c])


def oracle(b):
    """(dx, dscale, dbias) in float64 from bngrad.reference, for the inputs the call will read."""
    x, dy, mean, invar, scale = inputs_2d(b)
    if b["is_train"]:
        return reference.batch_norm_backward(dy, x, scale, None, None, mean, invar, True)
    _, _, dscale, dbias = reference.batch_norm_backward_reduce(dy, x, mean, invar, scale)
    return dy.astype(F64) * invar.astype(F64) * scale.astype(F64), dscale, dbias


def assert_matches_oracle(b, expected):
    x, dy, mean, invar, scale = inputs_2d(b)
    s = backward_scales(dy, x, scale, mean, invar)
    n, c = b["batch"] * b["channel"], b["channel"]
    dx = b["dx"].reshape(-1)[:n].reshape(b["batch"], c)
    assert_close(dx, expected[0], what="dx", scale=s["grad_input"])
    assert_close(b["dscale"][:c], expected[1], what="dscale", scale=s["grad_weight"])
    assert_close(b["dbias"][:c], expected[2], what="dbias", scale=s["grad_bias"])


def snapshot(b):
    return {k: b[k].copy() for k in ("dx", "dbias", "dscale")}


# --------------------------------------------------------------------------- the seed's examples

def test_seed_example_shared_storage():
    """FT78NE example: batch 4, channel 64, is_train, core_mask 0xff."""
    batch, channel, is_train, core_mask = 4, 64, True, 0xff
    b = make_buffers(batch, channel, train=is_train)
    params = [0] * 12
    params[0], params[1], params[2] = b["mean"], b["invar"], b["scale"]
    params[3], params[4] = b["dbias"], b["dscale"]
    params[5], params[6], params[7] = batch, channel, int(is_train)
    expected = oracle(b)
    assert dsp.fp_batch_norm_grad_s(b["x"], b["dy"], b["dx"], params, core_mask) is None
    assert_matches_oracle(b, expected)


def test_seed_example_private_storage():
    """FT78NE example: batch 4, channel 32, is_train, one core."""
    batch, channel, is_train = 4, 32, True
    b = make_buffers(batch, channel, train=is_train, seed=1)
    params = [0] * 12
    params[0], params[1], params[2] = b["mean"], b["invar"], b["scale"]
    params[3], params[4] = b["dbias"], b["dscale"]
    params[5], params[6], params[7] = batch, channel, int(is_train)
    expected = oracle(b)
    assert dsp.fp_batch_norm_grad_p(b["x"], b["dy"], b["dx"], params) is None
    assert_matches_oracle(b, expected)


# --------------------------------------------------------------------------- results

HP_PARAM_DTYPES = {
    "p16": (F16,) * 5,
    "p32": (F32,) * 5,
    "mixed": (F16, F32, F16, F32, F16),   # each buffer its own dtype
}


# fp_ takes float32 per-channel buffers only (float16 ones are among the bad arguments)
DTYPE_CASES = [("fp_s", "p32"), ("fp_p", "p32")] + [
    (fn, pdt) for fn in ("hp_s", "hp_p") for pdt in HP_PARAM_DTYPES]


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("fn, pdt", DTYPE_CASES, ids=[f"{f}-{p}" for f, p in DTYPE_CASES])
def test_matches_reference(fn, pdt, train):
    func, half = FUNCTIONS[fn]
    dtypes = HP_PARAM_DTYPES[pdt]
    b = make_buffers(6, 37, half=half, param_dtypes=dtypes, train=train, seed=3)
    expected = oracle(b)
    args = (b["x"], b["dy"], b["dx"], params_of(b)) + ((0xFF,) if fn.endswith("_s") else ())
    func(*args)
    assert_matches_oracle(b, expected)
    for name, dtype in zip(("dbias", "dscale"), dtypes[3:]):
        assert b[name].dtype == dtype   # written in the buffer's own dtype


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_eval_and_train_formulas_differ_as_specified(train):
    """is_train=0 is dx = dy*invar*scale; is_train=1 removes the mean and the xhat projection."""
    b = make_buffers(5, 9, train=False, seed=4)
    b["is_train"] = int(train)
    dsp.fp_batch_norm_grad_p(b["x"], b["dy"], b["dx"], params_of(b))
    x, dy, mean, invar, scale = (a.astype(F64) for a in inputs_2d(b))
    plain = dy * invar * scale
    dx = b["dx"].reshape(5, 9).astype(F64)
    if train:
        xhat = (x - mean) * invar
        m = 5
        seed_formula = scale * invar / m * (m * dy - dy.sum(0) - xhat * (dy * xhat).sum(0))
        assert_close(b["dx"].reshape(5, 9), seed_formula, what="dx", scale=np.abs(plain).max() * 3)
        assert np.abs(dx - plain).max() > 1e-2   # the train terms are really there
    else:
        assert_close(b["dx"].reshape(5, 9), plain, what="dx")


def test_two_dimensional_buffers_equal_flat_ones():
    flat = make_buffers(4, 10, seed=5)
    square = make_buffers(4, 10, seed=5, flat=False)
    dsp.fp_batch_norm_grad_s(flat["x"], flat["dy"], flat["dx"], params_of(flat))
    dsp.fp_batch_norm_grad_s(square["x"], square["dy"], square["dx"], params_of(square))
    np.testing.assert_array_equal(flat["dx"], square["dx"].reshape(-1))
    np.testing.assert_array_equal(flat["dbias"], square["dbias"])
    np.testing.assert_array_equal(flat["dscale"], square["dscale"])


@pytest.mark.parametrize("fn", ["fp_s", "hp_p"])
def test_longer_buffers_use_only_their_prefix(fn):
    func, half = FUNCTIONS[fn]
    b = make_buffers(3, 8, half=half, seed=6, extra=5)
    expected = oracle(b)
    func(b["x"], b["dy"], b["dx"], params_of(b))
    assert_matches_oracle(b, expected)
    for name in ("dx", "dbias", "dscale"):
        np.testing.assert_array_equal(b[name][-5:], SENTINEL, err_msg=f"{name}'s tail written")


def test_strided_flat_buffers():
    """A 1-D view with a stride (every other element) is a valid buffer too."""
    b = make_buffers(4, 6, seed=7)
    expected = oracle(b)
    big = {k: np.repeat(b[k], 2) for k in ("x", "dy", "dx")}
    views = {k: v[::2] for k, v in big.items()}
    dsp.fp_batch_norm_grad_s(views["x"], views["dy"], views["dx"], params_of(b))
    b["dx"] = views["dx"].copy()
    assert_matches_oracle(b, expected)
    np.testing.assert_array_equal(big["dx"][1::2], SENTINEL)   # the gaps are untouched


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("fn", ["fp_s", "hp_s"])
@pytest.mark.parametrize("target", ["dy", "x"])
def test_in_place(fn, train, target):
    """dx may be the very buffer of dy (or x): same result as into a separate buffer."""
    func, half = FUNCTIONS[fn]
    separate = make_buffers(6, 11, half=half, train=train, seed=8)
    in_place = make_buffers(6, 11, half=half, train=train, seed=8)
    expected = oracle(in_place)
    func(separate["x"], separate["dy"], separate["dx"], params_of(separate))
    func(in_place["x"], in_place["dy"], in_place[target], params_of(in_place))
    np.testing.assert_array_equal(in_place[target], separate["dx"])
    np.testing.assert_array_equal(in_place["dscale"], separate["dscale"])
    np.testing.assert_array_equal(in_place["dbias"], separate["dbias"])
    in_place["dx"] = in_place[target]
    assert_matches_oracle(in_place, expected)


# --------------------------------------------------------------------------- core_mask

def test_threads_for_core_mask(monkeypatch):
    monkeypatch.setattr(dsp.os, "cpu_count", lambda: 64)
    assert dsp.threads_for_core_mask(0xFF) == 8
    assert dsp.threads_for_core_mask(0x1) == 1
    assert dsp.threads_for_core_mask(0b1010_0001) == 3
    assert dsp.threads_for_core_mask(np.int64(0xF0)) == 4
    assert dsp.threads_for_core_mask(dsp.CORE_MASK_MAX) == 31   # the largest mask: 31 cores
    monkeypatch.setattr(dsp.os, "cpu_count", lambda: 16)
    assert dsp.threads_for_core_mask(dsp.CORE_MASK_MAX) == 16   # capped at the machine's cores
    monkeypatch.setattr(dsp.os, "cpu_count", lambda: 2)
    assert dsp.threads_for_core_mask(0xFF) == 2


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_core_mask_reaches_the_core(monkeypatch, train):
    """_s: popcount(core_mask) threads; _p: one thread (private storage, one core)."""
    seen = []
    name = "batch_norm_backward" if train else "batch_norm_backward_reduce"
    real = getattr(dsp.api, name)

    def spy(*args, **kwargs):
        seen.append(kwargs["num_threads"])
        return real(*args, **kwargs)

    monkeypatch.setattr(dsp.api, name, spy)
    monkeypatch.setattr(dsp.os, "cpu_count", lambda: 64)
    for fn in FUNCTIONS:
        func, half = FUNCTIONS[fn]
        b = make_buffers(2, 3, half=half, train=train)
        args = (b["x"], b["dy"], b["dx"], params_of(b))
        func(*args, core_mask=0b1011) if fn.endswith("_s") else func(*args)
    assert seen == [3, 1, 3, 1]


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("half", [False, True], ids=["fp", "hp"])
def test_results_identical_for_every_core_mask(half, train):
    results = []
    for mask in (0x1, 0x3, 0xFF, 0x7FFFFFFF, None):
        b = make_buffers(64, 200, half=half, train=train, seed=9)
        if mask is None:
            (dsp.hp_batch_norm_grad_p if half else dsp.fp_batch_norm_grad_p)(
                b["x"], b["dy"], b["dx"], params_of(b))
        else:
            (dsp.hp_batch_norm_grad_s if half else dsp.fp_batch_norm_grad_s)(
                b["x"], b["dy"], b["dx"], params_of(b), core_mask=mask)
        results.append(snapshot(b))
    bits = lambda a: a.view(f"u{a.itemsize}")  # noqa: E731  (bitwise, NaN-safe)
    for other in results[1:]:
        for name in ("dx", "dbias", "dscale"):
            np.testing.assert_array_equal(bits(other[name]), bits(results[0][name]), err_msg=name)


@pytest.mark.parametrize("mask, error", [
    (0, ArgumentValueError), (-1, ArgumentValueError), (-0xFF, ArgumentValueError),
    (0x80000000, ArgumentValueError), (2 ** 100 - 1, ArgumentValueError),  # beyond C's int
    (np.uint64(0xFFFFFFFF), ArgumentValueError),
    (1.5, ArgumentTypeError), (255.0, ArgumentTypeError), ("0xff", ArgumentTypeError),
    (True, ArgumentTypeError), (None, ArgumentTypeError),
])
def test_bad_core_mask(mask, error):
    b = make_buffers(2, 3)
    before = snapshot(b)
    with pytest.raises(error, match="core_mask"):
        dsp.fp_batch_norm_grad_s(b["x"], b["dy"], b["dx"], params_of(b), core_mask=mask)
    for name, value in before.items():
        np.testing.assert_array_equal(b[name], value)


# --------------------------------------------------------------------------- the typed helper

def test_params_dataclass():
    b1, b2, b3 = (make_buffers(3, 5, seed=10) for _ in range(3))
    p = dsp.BatchNormGradParams(mean=b2["mean"], invar=b2["invar"], scale=b2["scale"],
                                dbias=b2["dbias"], dscale=b2["dscale"], batch=3, channel=5)
    as_list = p.as_params()
    assert len(as_list) == 12 and as_list[5:8] == [3, 5, 1] and as_list[8:] == [0] * 4
    assert as_list[3] is b2["dbias"] and as_list[4] is b2["dscale"]
    dsp.fp_batch_norm_grad_s(b1["x"], b1["dy"], b1["dx"], params_of(b1))
    dsp.fp_batch_norm_grad_s(b2["x"], b2["dy"], b2["dx"], as_list)
    q = dsp.BatchNormGradParams(b3["mean"], b3["invar"], b3["scale"], b3["dbias"], b3["dscale"],
                                3, 5, is_train=True)
    dsp.fp_batch_norm_grad_s(b3["x"], b3["dy"], b3["dx"], q)   # the dataclass itself works too
    for other in (b2, b3):
        for name in ("dx", "dbias", "dscale"):
            np.testing.assert_array_equal(other[name], b1[name])


@pytest.mark.parametrize("is_train", [0.5, 2, -1, "no", "1", None, 1.0])
def test_params_dataclass_refuses_is_train_other_than_0_or_1(is_train):
    """int(0.5) would silently run eval mode, int("no") fail without naming the argument."""
    b = make_buffers(3, 5, seed=10)
    before = snapshot(b)
    fields = dict(mean=b["mean"], invar=b["invar"], scale=b["scale"], dbias=b["dbias"],
                  dscale=b["dscale"], batch=3, channel=5)
    with pytest.raises(ArgumentValueError, match="is_train"):
        dsp.BatchNormGradParams(**fields, is_train=is_train)
    p = dsp.BatchNormGradParams(**fields)
    p.is_train = is_train  # set after construction: refused when used
    for use in (p.as_params,
                lambda: dsp.fp_batch_norm_grad_s(b["x"], b["dy"], b["dx"], p)):
        with pytest.raises(ArgumentValueError, match="is_train"):
            use()
    for name, value in before.items():
        np.testing.assert_array_equal(b[name], value)


@pytest.mark.parametrize("is_train, expected", [(True, 1), (False, 0), (1, 1), (0, 0),
                                                (np.bool_(False), 0), (np.int64(1), 1)])
def test_params_dataclass_is_train_forms(is_train, expected):
    b = make_buffers(3, 5)
    p = dsp.BatchNormGradParams(b["mean"], b["invar"], b["scale"], b["dbias"], b["dscale"], 3,
                                5, is_train=is_train)
    as_list = p.as_params()
    assert as_list[7] == expected and type(as_list[7]) is int


@pytest.mark.parametrize("container", [tuple, lambda p: np.array(p, dtype=object)],
                         ids=["tuple", "object-array"])
def test_params_other_sequences(container):
    b1, b2 = make_buffers(3, 5, seed=11), make_buffers(3, 5, seed=11)
    dsp.fp_batch_norm_grad_p(b1["x"], b1["dy"], b1["dx"], params_of(b1))
    dsp.fp_batch_norm_grad_p(b2["x"], b2["dy"], b2["dx"], container(params_of(b2)))
    np.testing.assert_array_equal(b1["dx"], b2["dx"])


def test_reserved_params_are_ignored_and_eight_suffice():
    b1, b2 = make_buffers(3, 5, seed=12), make_buffers(3, 5, seed=12)
    p = params_of(b1)
    p[8:] = ["junk", None, object(), 1.5]
    dsp.fp_batch_norm_grad_p(b1["x"], b1["dy"], b1["dx"], p)
    dsp.fp_batch_norm_grad_p(b2["x"], b2["dy"], b2["dx"], params_of(b2)[:8])
    np.testing.assert_array_equal(b1["dx"], b2["dx"])


# --------------------------------------------------------------------------- bad arguments

def _set(key, value):
    """Case: params[key] (int key) or buffer ``key`` replaced by ``value`` (or ``value(b)``)."""
    def make(b):
        new = value(b) if callable(value) else value
        if isinstance(key, int):
            p = params_of(b)
            p[key] = new
            return p
        b[key] = new
        return params_of(b)
    return make


def _short(name, n=1):
    return _set(name, lambda b: b[name][:-n])


def _as(name, dtype):
    return _set(name, lambda b: b[name].astype(dtype))


def _read_only(name):
    def make(b):
        a = b[name]
        a.flags.writeable = False
        return a
    return _set(name, make)


def _dx_shifted_over(name):
    """dx one element further into the very buffer of ``name``: a partial overlap."""
    def make(b):
        buf = np.concatenate([b[name], np.zeros(1, b[name].dtype)])
        b[name], b["dx"] = buf[:-1], buf[1:]
        return params_of(b)
    return make


def _same_buffer(out, other):
    def make(b):
        b[out] = b[other]
        return params_of(b)
    return make


BAD = {
    # params itself
    "params-too-short": (lambda b: params_of(b)[:7], ArgumentValueError, "at least 8 entries"),
    "params-None": (None, ArgumentTypeError, "params"),
    "params-int": (42, ArgumentTypeError, "params"),
    "params-str": ("params", ArgumentTypeError, "params"),
    "params-dict": ({"batch": 4}, ArgumentTypeError, "params"),
    # batch, channel, is_train
    "batch-0": (_set(5, 0), ArgumentValueError, r"params\[5\] \(batch\)"),
    "batch-negative": (_set(5, -4), ArgumentValueError, "batch"),
    "batch-float": (_set(5, 4.0), ArgumentTypeError, "batch"),
    "batch-str": (_set(5, "4"), ArgumentTypeError, "batch"),
    "batch-bool": (_set(5, True), ArgumentTypeError, "batch"),
    "batch-None": (_set(5, None), ArgumentTypeError, "batch"),
    "channel-0": (_set(6, 0), ArgumentValueError, r"params\[6\] \(channel\)"),
    "channel-negative": (_set(6, -1), ArgumentValueError, "channel"),
    "channel-float": (_set(6, 6.5), ArgumentTypeError, "channel"),
    "channel-array": (_set(6, lambda b: b["mean"]), ArgumentTypeError, "channel"),
    "is_train-2": (_set(7, 2), ArgumentValueError, "is_train"),
    "is_train-float": (_set(7, 0.5), ArgumentValueError, "is_train"),
    "is_train-None": (_set(7, None), ArgumentValueError, "is_train"),
    "is_train-str": (_set(7, "no"), ArgumentValueError, "is_train"),
    # data buffers too short / wrong shape
    "x-short": (_short("x"), ArgumentValueError, "x: expected at least batch"),
    "dy-short": (_short("dy"), ArgumentValueError, "dy: expected at least batch"),
    "dx-short": (_short("dx"), ArgumentValueError, "dx: expected at least batch"),
    "x-2d-transposed": (_set("x", lambda b: b["x"].reshape(6, 4)), ArgumentValueError,
                        r"x: expected shape \(batch, channel\)"),
    "dx-3d": (_set("dx", lambda b: b["dx"].reshape(2, 2, 6)), ArgumentValueError, "dx"),
    # per-channel buffers too short / wrong shape
    "mean-short": (_short("mean"), ArgumentValueError, r"params\[0\] \(mean\)"),
    "invar-short": (_short("invar"), ArgumentValueError, r"params\[1\] \(invar\)"),
    "scale-short": (_short("scale"), ArgumentValueError, r"params\[2\] \(scale\)"),
    "dbias-short": (_short("dbias"), ArgumentValueError, r"params\[3\] \(dbias\)"),
    "dscale-short": (_short("dscale"), ArgumentValueError, r"params\[4\] \(dscale\)"),
    "scale-2d": (_set("scale", lambda b: b["scale"].reshape(2, 3)), ArgumentValueError, "scale"),
    # wrong dtypes
    "x-float64": (_as("x", F64), ArgumentTypeError, "x: expected dtype float32"),
    "dy-float16": (_as("dy", F16), ArgumentTypeError, "dy"),
    "dx-float64": (_as("dx", F64), ArgumentTypeError, "dx"),
    "mean-float16-in-fp": (_as("mean", F16), ArgumentTypeError, "mean"),
    "invar-float64": (_as("invar", F64), ArgumentTypeError, "invar"),
    "scale-int": (_as("scale", np.int32), ArgumentTypeError, "scale"),
    "dbias-float64": (_as("dbias", F64), ArgumentTypeError, "dbias"),
    "dscale-bfloat16": (_as("dscale", ml_dtypes.bfloat16), ArgumentTypeError, "dscale"),
    "x-big-endian": (_as("x", np.dtype(">f4")), ArgumentTypeError, "x"),
    # not arrays / not writable
    "x-list": (_set("x", lambda b: b["x"].tolist()), ArgumentTypeError, "x: expected a NumPy"),
    "mean-list": (_set("mean", lambda b: b["mean"].tolist()), ArgumentTypeError, "mean"),
    "dbias-list": (_set("dbias", lambda b: b["dbias"].tolist()), ArgumentTypeError, "dbias"),
    "dscale-None": (_set("dscale", None), ArgumentTypeError, "dscale"),
    "dbias-int": (_set("dbias", 0), ArgumentTypeError, "dbias"),
    "dx-read-only": (_read_only("dx"), ArgumentValueError, "dx: expected a writable"),
    "dbias-read-only": (_read_only("dbias"), ArgumentValueError, "dbias.*writable"),
    "dscale-read-only": (_read_only("dscale"), ArgumentValueError, "dscale.*writable"),
    # overlaps
    "dx-partly-over-dy": (_dx_shifted_over("dy"), ArgumentValueError, "dx: overlaps dy"),
    "dx-partly-over-x": (_dx_shifted_over("x"), ArgumentValueError, "dx: overlaps x"),
    "dscale-is-dbias": (_same_buffer("dscale", "dbias"), ArgumentValueError, "dbias.*dscale"),
    "dbias-is-mean": (_same_buffer("dbias", "mean"), ArgumentValueError, "dbias.*mean"),
    "dx-over-invar": (_set("invar", lambda b: b["dx"][:6]), ArgumentValueError,
                      "dx: shares memory with invar"),
    "dx-over-mean": (_set("mean", lambda b: b["dx"][10:16]), ArgumentValueError,
                     "dx: shares memory with mean"),
    # outputs whose elements share memory: each would keep the last value written
    "dx-stride-0": (_set("dx", lambda b: as_strided(b["dx"], (24,), (0,))), ArgumentValueError,
                    "dx: its elements overlap"),
    "dx-rows-overlap": (_set("dx", lambda b: as_strided(b["dx"], (4, 6), (8, 4))),
                        ArgumentValueError, "dx: its elements overlap"),
    "dbias-stride-0": (_set("dbias", lambda b: as_strided(b["dbias"], (6,), (0,))),
                       ArgumentValueError, r"params\[3\] \(dbias\): its elements overlap"),
    # masked arrays: their masks would be ignored
    "mean-masked": (_set("mean", lambda b: np.ma.masked_array(b["mean"], mask=True)),
                    ArgumentTypeError, r"params\[0\] \(mean\): .*masked array"),
    "x-masked": (_set("x", lambda b: np.ma.masked_array(b["x"])), ArgumentTypeError,
                 "^x: .*masked array"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_arguments_raise_before_writing(case):
    make_params, error, pattern = BAD[case]
    b = make_buffers(4, 6, seed=13)
    params = make_params(b) if callable(make_params) else make_params
    before = {k: np.array(b[k], copy=True) for k in ("dx", "dbias", "dscale")
              if isinstance(b[k], np.ndarray)}
    with pytest.raises(error, match=pattern):
        dsp.fp_batch_norm_grad_s(b["x"], b["dy"], b["dx"], params)
    for name, value in before.items():
        np.testing.assert_array_equal(b[name], value, err_msg=f"{name} written despite the error")


@pytest.mark.parametrize("name, dtype, pattern", [
    ("x", F32, "x: expected dtype float16"),
    ("dy", F64, "dy"),
    ("dx", F32, "dx"),
    ("mean", F64, r"\(mean\): expected dtype float16 or float32"),
    ("dscale", ml_dtypes.bfloat16, "dscale"),
    ("x", ml_dtypes.bfloat16, "x"),
])
def test_hp_wrong_dtypes(name, dtype, pattern):
    b = make_buffers(4, 6, half=True, seed=14)
    b[name] = b[name].astype(dtype)
    with pytest.raises(ArgumentTypeError, match=pattern):
        dsp.hp_batch_norm_grad_p(b["x"], b["dy"], b["dx"], params_of(b))


def test_fp_rejects_float16_data():
    b = make_buffers(4, 6, half=True, param_dtypes=(F32,) * 5)
    with pytest.raises(ArgumentTypeError, match="x: expected dtype float32"):
        dsp.fp_batch_norm_grad_p(b["x"], b["dy"], b["dx"], params_of(b))


def test_error_messages_say_what_arrived():
    b = make_buffers(4, 6)
    with pytest.raises(ArgumentValueError) as info:
        dsp.fp_batch_norm_grad_p(b["x"][:23], b["dy"], b["dx"], params_of(b))
    message = str(info.value)
    assert "4*6 = 24" in message and "got 23" in message


def test_cpu_count_is_the_cap():
    assert dsp.threads_for_core_mask(0xFF) == min(8, os.cpu_count() or 1)


def test_hp_float16_sums_are_rounded_once():
    """float16 dbias gets the float64 sum rounded once, not via float32.

    sum(dy) = 2049 + 2**-19: just above the float16 halfway point 2049, so it rounds to 2050.
    Rounded to float32 first it would become exactly 2049, a tie that rounds to even, 2048.
    """
    batch, channel = 4, 1
    dy = np.array([2048, 1, 2.0 ** -19, 0], np.float16)
    x = np.array([1, 2, 3, 4], np.float16)
    one = np.ones(channel, np.float16)
    dbias, dscale = np.empty(channel, np.float16), np.empty(channel, np.float16)
    dx = np.empty(batch * channel, np.float16)
    dsp.hp_batch_norm_grad_p(x, dy, dx, [one * 2, one, one, dbias, dscale, batch, channel, 1])
    assert float(dbias[0]) == 2050.0


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("dtype, param_dtype", [("fp32", None), ("fp16", None), ("fp16", "fp32")])
def test_every_output_is_the_float64_result_rounded_once(dtype, param_dtype, train):
    """What docs/dsp.md promises: dx, dbias and dscale equal the float64 reference rounded once
    to their buffer's dtype (the golden vectors' expected files), element for element; with
    float16 data and float32 per-channel buffers too (eval's dscale was 1-43 ULP off: the
    kernels sum half data's terms in float32 blocks)."""
    from bngrad import vectors

    v = vectors.generate(512, 48, dtype, train=train, seed=11, param_dtype=param_dtype)
    a = v.arrays
    dx, dbias, dscale = (np.empty_like(a[n]) for n in ("dx", "dbias", "dscale"))
    func = dsp.fp_batch_norm_grad_s if dtype == "fp32" else dsp.hp_batch_norm_grad_s
    func(a["x"].ravel(), a["dy"].ravel(), dx.ravel(),
         [a["mean"], a["invar"], a["scale"], dbias, dscale, 512, 48, int(train)], 0xFF)
    for name, got in (("dx", dx), ("dbias", dbias), ("dscale", dscale)):
        assert np.array_equal(got, a[name]), (name, int((got != a[name]).sum()))
