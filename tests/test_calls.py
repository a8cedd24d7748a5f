"""Repeat calls (bngrad._calls): a call whose signature passed every check before skips the
checks of structure, and gets bitwise what the full checks give; the checks of values still
run; calls that are not plain are never taken for a remembered one."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import bngrad
from bngrad import _calls
from conftest import DTYPE_VARIANTS, LAYOUT_PAIRS, MASKS, make_case, mask_id, results_bits


@pytest.fixture(autouse=True)
def _forget():
    _calls._known.clear()
    yield
    _calls._known.clear()


def _backward(case, **kwargs):
    return bngrad.batch_norm_backward(*case.args(), **case.kwargs(), **kwargs)


def _forward(case, running=True, **kwargs):
    """A forward on the case's input, with copies of its running statistics."""
    rm = None if not running or case.running_mean is None else case.running_mean.copy()
    rv = None if not running or case.running_var is None else case.running_var.copy()
    result = bngrad.batch_norm_forward(case.input, case.weight, case.weight, rm, rv, case.train,
                                       **case.kwargs(), **kwargs)
    return list(result) + [rm, rv]


@pytest.mark.parametrize("layouts", [p[1:] for p in LAYOUT_PAIRS
                                     if p[0] in ("contig", "chlast", "sliced/chlast")],
                         ids=lambda p: "/".join(p))
@pytest.mark.parametrize("variant", DTYPE_VARIANTS, ids=lambda v: v.id)
@pytest.mark.parametrize("mode", ["train", "train-nostats", "eval"])
def test_a_remembered_call_gives_the_bits_of_a_checked_one(layouts, variant, mode):
    for shape, axis in (((4, 6, 3, 5), 1), ((40, 12), 1), ((3, 5, 4, 6), -1)):
        for mask in (MASKS[0], (True, False, False), (False, True, True)):
            case = make_case(shape, axis, variant, mode, output_mask=mask, layouts=layouts)
            _calls._known.clear()
            first = _backward(case)
            assert len(_calls._known) == 1  # remembered
            assert results_bits(_backward(case)) == results_bits(first), (shape, axis,
                                                                          mask_id(mask))
        if mode == "train-nostats":
            continue
        _calls._known.clear()
        first = _forward(case)
        assert len(_calls._known) == 1
        assert results_bits(_forward(case)) == results_bits(first), (shape, axis)


def test_a_remembered_call_into_out_and_on_every_thread_count():
    case = make_case((8, 16, 5, 5), 1, "float32", "train")
    expected = _backward(case)
    for threads, _ in itertools.product((1, 2, 3), range(2)):
        out = np.empty_like(case.input)
        result = _backward(case, num_threads=threads, out=out)
        assert result[0] is out
        assert results_bits(result) == results_bits(expected)


def _remembered_forward():
    case = make_case((4, 6, 3, 5), 1, "float32", "train")
    rm, rv = case.running_mean.copy(), case.running_var.copy()
    args = [case.input, case.weight, case.weight, rm, rv, True]
    bngrad.batch_norm_forward(*args)
    assert len(_calls._known) == 1
    return args


@pytest.mark.parametrize("change, kwargs, error, message", [
    ("negative running_var", {}, bngrad.ArgumentValueError, "running_var: expected variances"),
    ("read-only running_mean", {}, bngrad.ArgumentValueError, "running_mean: expected a writable"),
    (None, {"eps": -1.0}, bngrad.ArgumentValueError, "eps:"),
    (None, {"momentum": float("nan")}, bngrad.ArgumentValueError, "momentum:"),
    (None, {"num_threads": 0}, bngrad.ArgumentValueError, "num_threads:"),
    (None, {"num_threads": 1.5}, bngrad.ArgumentTypeError, "num_threads:"),
    ("out overlapping input", {}, bngrad.ArgumentValueError, "out: overlaps input"),
    ("read-only out", {}, bngrad.ArgumentValueError, "out: expected a writable"),
    ("out of another dtype", {}, bngrad.ArgumentTypeError, "out: expected the dtype"),
])
def test_a_remembered_forward_still_checks_values(change, kwargs, error, message):
    args = _remembered_forward()
    x, rm, rv = args[0], args[3], args[4]
    if change == "negative running_var":
        rv[2] = -1.0
    elif change == "read-only running_mean":
        rm.flags.writeable = False
    elif change == "out overlapping input":
        buffer = np.concatenate([x.ravel(), x.ravel()])
        args[0] = buffer[:x.size].reshape(x.shape)
        kwargs = {"out": buffer[1:x.size + 1].reshape(x.shape)}
    elif change == "read-only out":
        out = np.empty_like(x)
        out.flags.writeable = False
        kwargs = {"out": out}
    elif change == "out of another dtype":
        kwargs = {"out": np.empty(x.shape)}
    with pytest.raises(error, match=message):
        bngrad.batch_norm_forward(*args, **kwargs)


def test_a_remembered_backward_still_checks_values():
    case = make_case((4, 6, 3, 5), 1, "float32", "eval")
    _backward(case)
    assert len(_calls._known) == 1
    with pytest.raises(bngrad.ArgumentValueError, match="eps:"):
        bngrad.batch_norm_backward(*case.args()[:8], -1.0, case.output_mask)
    case.running_var[1] = -2.0
    with pytest.raises(bngrad.ArgumentValueError, match="running_var: expected variances"):
        _backward(case)
    case.running_var[1] = 1.0
    with pytest.raises(bngrad.ArgumentValueError, match="out: overlaps grad_out"):
        _backward(case, out=case.grad_out[::-1])
    train = make_case((4, 6, 3, 5), 1, "float32", "train")
    _backward(train)
    with pytest.raises(bngrad.ArgumentValueError, match="save_mean, save_invstd: expected both"):
        bngrad.batch_norm_backward(*train.args()[:5], train.save_mean, np.empty(0, np.float32),
                                   True)


@pytest.mark.parametrize("unusual, error", [
    ({"train": 1}, bngrad.ArgumentTypeError),          # equal to True as a key, not a bool
    ({"channel_axis": True}, bngrad.ArgumentTypeError),  # equal to 1 as a key, not an int
    ({"channel_axis": 1.0}, bngrad.ArgumentTypeError),
    ({"output_mask": (1, 1, 1)}, bngrad.ArgumentValueError),
])
def test_values_equal_to_a_remembered_signature_are_still_refused(unusual, error):
    case = make_case((4, 6, 3, 5), 1, "float32", "train")
    _backward(case)
    kwargs = {"train": True, "output_mask": (True, True, True), "channel_axis": 1, **unusual}
    with pytest.raises(error):
        bngrad.batch_norm_backward(*case.args()[:7], kwargs.pop("train"), 1e-5,
                                   kwargs.pop("output_mask"), **kwargs)
    assert len(_calls._known) == 1


def test_calls_that_are_not_plain_are_checked_in_full_and_not_remembered():
    case = make_case((4, 6, 3, 5), 1, "float64", "train")
    expected = _backward(case)
    _calls._known.clear()
    as_lists = [case.grad_out, case.input.tolist(), case.weight.tolist(), None, None,
                case.save_mean, case.save_invstd, np.True_, 1e-5, [True, True, True]]
    assert results_bits(bngrad.batch_norm_backward(*as_lists)) == results_bits(expected)
    assert not _calls._known
    with pytest.raises(bngrad.ArgumentValueError, match="weight: expected shape"):
        bngrad.batch_norm_backward(*case.args()[:2], case.weight[:3], *case.args()[3:])
    assert not _calls._known  # a refused call is not remembered


@pytest.mark.parametrize("variant", ["float32", "bfloat16-p32"])
@pytest.mark.parametrize("layouts", [("contig", "contig"), ("chlast", "contig")],
                         ids=lambda p: "/".join(p))
def test_fused_calls_share_what_is_remembered(variant, layouts):
    """bngrad.fused's calls go through the same checks: a fused call after a plain one of the
    same signature (and the reverse) gives the bits it gives alone."""
    from bngrad import fused
    case = make_case((4, 6, 3, 5), 1, variant, "train", layouts=layouts)
    side = case.grad_out[::-1].copy()

    def fused_pair():
        forward = fused.batch_norm_relu_forward(case.input, case.weight, case.weight,
                                                side_input=side)
        backward = fused.batch_norm_relu_backward(case.grad_out, case.input, case.weight, None,
                                                  None, forward[1], forward[2],
                                                  relu_mask=forward[3])
        return list(forward) + list(backward)

    alone = results_bits(fused_pair())
    assert len(_calls._known) == 2
    assert results_bits(fused_pair()) == alone
    _calls._known.clear()
    _, mean, invstd = bngrad.batch_norm_forward(case.input, case.weight, case.weight)
    bngrad.batch_norm_backward(case.grad_out, case.input, case.weight, None, None, mean, invstd)
    assert len(_calls._known) == 2
    assert results_bits(fused_pair()) == alone
    assert len(_calls._known) == 2  # the plain calls' signatures served the fused ones


@pytest.mark.parametrize("path", ["fused", "fused_short", "lanes", "runs", "short"])
@pytest.mark.parametrize("variant", ["float32", "bfloat16"])
def test_a_repeat_call_on_any_path_skips_the_layout_and_keeps_the_bits(path, variant,
                                                                       monkeypatch):
    """A repeat training backward whose layout copies nothing makes its views itself on
    every path (a forward where its kernel call also takes the moments: a fused path), never
    planning the layout; its results are the bits of the first, planned, call (api._direct)."""
    from bngrad import api, kernels
    shape, layouts = {"fused": ((4, 6, 300), "contig"), "fused_short": ((8, 12, 49), "contig"),
                      "lanes": ((8, 12, 7, 7), "chlast"), "runs": ((4, 6, 300), "contig"),
                      "short": ((8, 12, 49), "contig")}[path]
    case = make_case(shape, 1, variant, "train", layouts=(layouts, layouts))
    with kernels.forced_path(path), kernels.override(serial_elements=0):
        assert api.plan(case.input, case.grad_out, 1, 2).kernel.path == path
        first_backward = _backward(case, num_threads=2)
        first_forward = _forward(case, num_threads=2)

        def no_planning(*args, **kwargs):
            raise AssertionError("a repeat call planned the layout")
        monkeypatch.setattr(api, "plan", no_planning)
        assert results_bits(_backward(case, num_threads=2)) == results_bits(first_backward)
        out = np.empty_like(case.input)
        result = _backward(case, num_threads=2, out=out)
        assert result[0] is out and results_bits(result) == results_bits(first_backward)
        if path in ("fused", "fused_short"):
            assert results_bits(_forward(case, num_threads=2)) == results_bits(first_forward)
        else:  # the moments take a pass of their own: the general path
            monkeypatch.undo()
            assert results_bits(_forward(case, num_threads=2)) == results_bits(first_forward)


@pytest.mark.parametrize("variant, parallel", [
    *((v, False) for v in ("float64", "float32", "float16-p32", "bfloat16")),
    ("float32", True), ("bfloat16", True)])  # (a parallel launch: compile time, few dtypes)
@pytest.mark.parametrize("layouts", [("contig", "contig"), ("chlast", "chlast")],
                         ids=lambda p: "/".join(p))
def test_a_repeat_one_call_skips_the_layout_and_keeps_the_bits(variant, layouts, parallel,
                                                               monkeypatch):
    """A repeat training call whose plan runs as one compiled pass (a small array) makes its
    views itself and never plans the layout; its results (and running statistics) are the
    bits of the first, checked and planned, call: into a new array, into out, in place."""
    from bngrad import api, kernels
    case = make_case((8, 8, 4, 4), 1, variant, "train", layouts=layouts)
    with kernels.override(**({"serial_elements": 0} if parallel else {})):
        plan = api.plan(case.input, case.grad_out, 1, 2).kernel
        assert plan.one_call and plan.serial is not parallel
        first_backward = _backward(case, num_threads=2)
        first_forward = _forward(case, num_threads=2)

        def no_planning(*args, **kwargs):
            raise AssertionError("a repeat one-call call planned the layout")
        monkeypatch.setattr(api, "plan", no_planning)
        assert results_bits(_backward(case, num_threads=2)) == results_bits(first_backward)
        assert results_bits(_forward(case, num_threads=2)) == results_bits(first_forward)
        out = np.empty_like(case.input)
        result = _backward(case, num_threads=2, out=out)
        assert result[0] is out and results_bits(result) == results_bits(first_backward)
        for which in (0, 1):  # out is grad_out, then input (in place)
            args = list(case.args())
            args[which] = args[which].copy(order="K")
            result = bngrad.batch_norm_backward(*args, **case.kwargs(), num_threads=2,
                                                out=args[which])
            assert result[0] is args[which] and results_bits(result) == results_bits(first_backward)
        # out in another layout than the plan's (Fortran order): the general path, same bits
        monkeypatch.undo()
        other = np.empty(case.input.shape[::-1], case.input.dtype).transpose(3, 2, 1, 0)
        assert (results_bits(_backward(case, num_threads=2, out=other))
                == results_bits(first_backward))
