"""Every bad input from the issue raises a clear exception naming the argument.

Each case says which public function, which argument is spoiled and how, the expected
builtin class (ValueError / TypeError: bngrad's exceptions subclass them and BngradError),
and the argument name the message must contain (plus, where it helps, what arrived).
"""

from __future__ import annotations

import numpy as np
import pytest

import bngrad
from bngrad import BngradError, reference
from tolerances import assert_close

F32 = np.float32
F64 = np.float64


def _base(n=4, c=3, s=5):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, c, s)).astype(F32)
    dy = rng.standard_normal((n, c, s)).astype(F32)
    vec = lambda v: np.full(c, v, dtype=F32)  # noqa: E731
    return {
        "backward": dict(grad_out=dy, input=x, weight=vec(1.0), running_mean=vec(0.0),
                         running_var=vec(1.0), save_mean=vec(0.0), save_invstd=vec(1.0),
                         train=True, eps=1e-5, output_mask=(True, True, True)),
        "forward": dict(input=x, weight=vec(1.0), bias=vec(0.0), running_mean=vec(0.0),
                        running_var=vec(1.0), train=True, momentum=0.1, eps=1e-5),
        "reduce": dict(grad_out=dy, input=x, mean=vec(0.0), invstd=vec(1.0), weight=vec(1.0),
                       input_g=True, weight_g=True, bias_g=True),
        "elemt": dict(grad_out=dy, input=x, mean=vec(0.0), invstd=vec(1.0), weight=vec(1.0),
                      sum_dy=vec(0.0), sum_dy_xmu=vec(0.0), count=n * s),
        "moments": dict(input=x),
    }


FUNCS = {
    "backward": bngrad.batch_norm_backward,
    "forward": bngrad.batch_norm_forward,
    "reduce": bngrad.batch_norm_backward_reduce,
    "elemt": bngrad.batch_norm_backward_elemt,
    "moments": bngrad.batch_norm_moments,
}

DATA_FUNCS = ("backward", "reduce", "elemt")          # take grad_out and input
ALL = ("backward", "forward", "reduce", "elemt", "moments")


def _x(shape, dtype=F32):
    return np.zeros(shape, dtype=dtype)


# (id, functions, changes to the valid arguments, exception, name in message, arrived text)
BAD = [
    ("grad_out-shape", DATA_FUNCS, dict(grad_out=_x((4, 3, 6))), ValueError, "grad_out", "6"),
    ("grad_out-ndim", DATA_FUNCS, dict(grad_out=_x((4, 15))), ValueError, "grad_out", None),
    ("grad_out-dtype", DATA_FUNCS, dict(grad_out=_x((4, 3, 5), np.float64)), TypeError,
     "grad_out", "float64"),
    ("grad_out-None", DATA_FUNCS, dict(grad_out=None), TypeError, "grad_out", None),
    ("input-1d", ("forward", "moments"), dict(input=_x((3,))), ValueError, "input", None),
    ("input-0d", ("forward", "moments"), dict(input=np.float32(1.0)), ValueError, "input", None),
    ("input-1d", DATA_FUNCS, dict(input=_x((3,)), grad_out=_x((3,))), ValueError, "input",
     None),
    ("input-int32", ("forward", "moments"), dict(input=_x((4, 3, 5), np.int32)), TypeError,
     "input", "int32"),
    ("input-ragged", ("forward", "moments"), dict(input=[[1.0, 2.0], [3.0]]), ValueError,
     "input", "list"),
    ("input-masked", ("forward", "moments"),
     dict(input=np.ma.masked_array(_x((4, 3, 5)), mask=False)), TypeError, "input", "masked"),
    ("grad_out-masked", DATA_FUNCS,
     dict(grad_out=np.ma.masked_array(_x((4, 3, 5)), mask=False)), TypeError, "grad_out",
     "masked"),
    ("input-bool", ("forward", "moments"), dict(input=_x((4, 3, 5), bool)), TypeError, "input",
     "bool"),
    ("input-complex", ("forward", "moments"), dict(input=_x((4, 3, 5), np.complex64)),
     TypeError, "input", "complex"),
    ("input-int64", DATA_FUNCS, dict(input=_x((4, 3, 5), np.int64),
                                      grad_out=_x((4, 3, 5), np.int64)), TypeError, "input",
     "int64"),
    ("input-uint8", DATA_FUNCS, dict(input=_x((4, 3, 5), np.uint8),
                                      grad_out=_x((4, 3, 5), np.uint8)), TypeError, "input",
     "uint8"),
    ("input-object", ("forward",), dict(input=np.full((4, 3, 5), "a", dtype=object)),
     TypeError, "input", None),
    ("input-None", ALL, dict(input=None), TypeError, "input", None),
    ("weight-length", ("backward", "forward", "reduce", "elemt"), dict(weight=_x(4)),
     ValueError, "weight", "4"),
    ("weight-2d", ("backward", "forward"), dict(weight=_x((3, 1))), ValueError, "weight", None),
    ("weight-int", ("backward", "forward"), dict(weight=np.ones(3, np.int32)), TypeError,
     "weight", "int32"),
    ("weight-float16", ("backward", "forward"), dict(weight=np.ones(3, np.float16)), TypeError,
     "weight", "float16"),
    ("bias-length", ("forward",), dict(bias=_x(2)), ValueError, "bias", "2"),
    ("running_mean-length", ("backward", "forward"), dict(running_mean=_x(5)), ValueError,
     "running_mean", "5"),
    ("running_var-length", ("backward", "forward"), dict(running_var=_x(1)), ValueError,
     "running_var", "1"),
    ("save_mean-length", ("backward",), dict(save_mean=_x(4)), ValueError, "save_mean", "4"),
    ("save_invstd-length", ("backward",), dict(save_invstd=_x(2)), ValueError, "save_invstd",
     "2"),
    ("mean-length", ("reduce", "elemt"), dict(mean=_x(4)), ValueError, "mean", "4"),
    ("invstd-length", ("reduce", "elemt"), dict(invstd=_x(4)), ValueError, "invstd", "4"),
    ("mean-None", ("reduce", "elemt"), dict(mean=None), ValueError, "mean", None),
    ("sum_dy-length", ("elemt",), dict(sum_dy=_x(4)), ValueError, "sum_dy", "4"),
    ("sum_dy_xmu-None", ("elemt",), dict(sum_dy_xmu=None), ValueError, "sum_dy_xmu", None),
    ("count-zero", ("elemt",), dict(count=0), ValueError, "count", None),
    ("count-negative", ("elemt",), dict(count=-5), ValueError, "count", None),
    ("count-text", ("elemt",), dict(count="many"), TypeError, "count", None),
    # A number in a string, a bool, a bool or string among per-rank counts: never a count.
    ("count-numeric-text", ("elemt",), dict(count="4"), TypeError, "count", "'4'"),
    ("count-bool", ("elemt",), dict(count=True), TypeError, "count", "True"),
    ("count-numpy-bool", ("elemt",), dict(count=np.bool_(True)), TypeError, "count", None),
    ("count-bool-array", ("elemt",), dict(count=np.array([True, True])), TypeError, "count",
     "bool"),
    ("count-rank-bool", ("elemt",), dict(count=[19, True]), TypeError, "count", "True"),
    ("count-rank-text", ("elemt",), dict(count=["10", "10"]), TypeError, "count", None),
    ("count-rank-negative", ("elemt",), dict(count=[30, -10]), ValueError, "count", "-10"),
    ("count-rank-nan", ("elemt",), dict(count=[20.0, float("nan")]), ValueError, "count",
     "nan"),
    ("count-huge", ("elemt",), dict(count=2 ** 1100), ValueError, "count", "too large"),
    ("count-rank-huge", ("elemt",), dict(count=[2 ** 1100]), ValueError, "count", "too large"),
    ("mean-masked", ("reduce", "elemt"), dict(mean=np.ma.masked_array(np.zeros(3, F32),
                                                                      mask=True)),
     TypeError, "mean", "masked"),
    ("weight-masked", ("backward", "forward", "reduce", "elemt"),
     dict(weight=np.ma.masked_array(np.ones(3, F32))), TypeError, "weight", "masked"),
    ("out-stride-0", ("backward", "forward", "elemt"),
     dict(out=np.lib.stride_tricks.as_strided(_x((1,)), (4, 3, 5), (0, 0, 0))), ValueError,
     "out", "overlap"),
    ("eps-negative", ("backward", "forward"), dict(eps=-1e-5), ValueError, "eps", None),
    ("eps-nan", ("backward", "forward"), dict(eps=float("nan")), ValueError, "eps", "nan"),
    ("eps-text", ("backward", "forward"), dict(eps="small"), TypeError, "eps", None),
    ("momentum-nan", ("forward",), dict(momentum=float("nan")), ValueError, "momentum", None),
    # ints beyond float64 (float() raised a bare OverflowError)
    ("eps-huge-int", ("backward", "forward"), dict(eps=10**400), ValueError, "eps",
     "too large for a float64"),
    ("momentum-huge-int", ("forward",), dict(momentum=10**400), ValueError, "momentum",
     "too large for a float64"),
    ("output_mask-two", ("backward",), dict(output_mask=(True, True)), (ValueError, TypeError),
     "output_mask", None),
    ("output_mask-four", ("backward",), dict(output_mask=[True] * 4), (ValueError, TypeError),
     "output_mask", None),
    ("output_mask-ints", ("backward",), dict(output_mask=(1, 0, 1)), (ValueError, TypeError),
     "output_mask", None),
    ("output_mask-str", ("backward",), dict(output_mask="111"), (ValueError, TypeError),
     "output_mask", None),
    ("output_mask-None", ("backward",), dict(output_mask=None), (ValueError, TypeError),
     "output_mask", None),
    ("train-text", ("backward", "forward"), dict(train="yes"), TypeError, "train", None),
    ("input_g-int", ("reduce",), dict(input_g=1), TypeError, "input_g", None),
    ("channel_axis-3", ALL, dict(channel_axis=3), ValueError, "channel_axis", "3"),
    ("channel_axis--4", ALL, dict(channel_axis=-4), ValueError, "channel_axis", "-4"),
    ("channel_axis-float", ALL, dict(channel_axis=1.0), TypeError, "channel_axis", None),
    ("num_threads-0", ALL, dict(num_threads=0), ValueError, "num_threads", "0"),
    ("num_threads--2", ALL, dict(num_threads=-2), ValueError, "num_threads", "-2"),
    ("num_threads-float", ALL, dict(num_threads=2.5), TypeError, "num_threads", None),
    ("eval-no-running", ("backward", "forward"),
     dict(train=False, running_mean=None, running_var=None), ValueError, "running_mean", None),
    ("eval-no-running_var", ("backward", "forward"), dict(train=False, running_var=None),
     ValueError, "running_var", None),
    ("eval-no-running_mean", ("backward", "forward"), dict(train=False, running_mean=None),
     ValueError, "running_mean", None),
]


def _cases():
    for ident, funcs, change, exc, name, arrived in BAD:
        for func in funcs:
            yield pytest.param(func, change, exc, name, arrived, id=f"{func}-{ident}")


@pytest.mark.parametrize("func,change,exc,name,arrived", list(_cases()))
def test_bad_input_raises_clear_error(func, change, exc, name, arrived):
    kwargs = {**_base()[func], **change}
    with pytest.raises(exc) as info:
        FUNCS[func](**kwargs)
    assert isinstance(info.value, BngradError), (
        f"expected a bngrad error (BngradError subclass), got {type(info.value).__name__}: "
        f"{info.value}")
    message = str(info.value)
    assert name in message, f"message does not name {name!r}: {message!r}"
    if arrived is not None:
        assert arrived in message, f"message does not say what arrived ({arrived!r}): {message!r}"


def test_error_classes_are_ordinary_value_and_type_errors():
    assert issubclass(bngrad.ArgumentValueError, ValueError)
    assert issubclass(bngrad.ArgumentTypeError, TypeError)
    assert issubclass(bngrad.ArgumentValueError, BngradError)
    assert issubclass(bngrad.ArgumentTypeError, BngradError)


def test_torch_tensor_input_is_a_clear_type_error():
    torch = pytest.importorskip("torch")
    x = torch.zeros(4, 3, 5)
    with pytest.raises(TypeError, match="input"):
        bngrad.batch_norm_forward(x)
    with pytest.raises(TypeError, match="grad_out|input"):
        bngrad.batch_norm_backward(x, x)


def test_read_only_running_stats_in_train_mode():
    """They are updated in place; a read-only array must be refused, not silently skipped."""
    kwargs = _base()["forward"]
    rm = kwargs["running_mean"].copy()
    rm.flags.writeable = False
    with pytest.raises(ValueError, match="running_mean"):
        bngrad.batch_norm_forward(**{**kwargs, "running_mean": rm})


@pytest.mark.parametrize("case", ["self", "each_other", "interleaved"])
def test_running_stats_whose_elements_overlap_in_train_mode(case):
    """Running statistics whose channels share memory would each keep whichever update came
    last (silently wrong values, found by hostile testing): refused, as an overlapping out=;
    two statistics interleaved in one buffer, without a shared element, work."""
    kwargs = _base()["forward"]
    C = kwargs["running_mean"].shape[0]
    buffer = np.zeros(2 * C, kwargs["running_mean"].dtype)
    if case == "self":
        rm = np.lib.stride_tricks.as_strided(buffer[:1], (C,), (0,))
        stats = {"running_mean": rm, "running_var": kwargs["running_var"].copy()}
    else:
        rm = buffer[0::2] if case == "interleaved" else buffer[:C]
        stats = {"running_mean": rm, "running_var": buffer[1::2] if case == "interleaved"
                 else buffer[:C]}
    if case == "interleaved":
        bngrad.batch_norm_forward(**{**kwargs, **stats})
        expected = reference.batch_norm_forward(**{**kwargs, "running_mean": np.zeros(C),
                                                   "running_var": np.zeros(C)})
        assert_close(stats["running_mean"], expected[3], rm.dtype, "running_mean")
        assert_close(stats["running_var"], expected[4], rm.dtype, "running_var")
        return
    name = "running_mean" + (", running_var" if case == "each_other" else "")
    with pytest.raises(ValueError, match=name):
        bngrad.batch_norm_forward(**{**kwargs, **stats})
    bngrad.batch_norm_forward(**{**kwargs, **stats, "train": False})  # only read in eval


@pytest.mark.parametrize("func", ["backward", "forward"])
def test_eval_without_running_stats_does_not_crash_where_torch_segfaults(func):
    """PyTorch segfaults on this; we raise. (Kept separate so the intent is on record.)"""
    kwargs = {**_base()[func], "train": False, "running_mean": None, "running_var": None}
    with pytest.raises(ValueError):
        FUNCS[func](**kwargs)


def test_valid_base_arguments_work():
    """The error cases above start from arguments that work, so each failure is its own."""
    for func, kwargs in _base().items():
        FUNCS[func](**kwargs)
        if func in ("backward", "forward"):
            FUNCS[func](**{**kwargs, "train": False})


# --------------------------------------------------------------------------- count of elemt

@pytest.mark.parametrize("count", [20, 20.0, np.int32(20), [20], [12, 0, 8],
                                   np.array([20, 0], np.int32), np.array([5.0, 15.0])],
                         ids=["int", "float", "int32", "list", "empty-rank", "int32-array",
                              "float-array"])
def test_elemt_count_forms(count):
    """A number, or per-rank counts (PyTorch passes a tensor of them); an empty rank counts 0."""
    kwargs = _base()["elemt"]
    expected = bngrad.batch_norm_backward_elemt(**kwargs)
    got = bngrad.batch_norm_backward_elemt(**{**kwargs, "count": count})
    np.testing.assert_array_equal(got, expected)


# --------------------------------------------------------------------------- NumPy guard rails

def _nhwc(dtype=F32):
    """An NHWC-shaped array (2, 5, 6, 14): 14 channels on the last axis."""
    return np.random.default_rng(1).standard_normal((2, 5, 6, 14)).astype(dtype)


@pytest.mark.parametrize("func", ["backward", "forward", "reduce", "elemt"])
def test_channels_last_without_channel_axis_names_the_likely_cause(func):
    x = _nhwc()
    vec = np.ones(14, F32)
    kwargs = {"backward": dict(grad_out=x, input=x, weight=vec),
              "forward": dict(input=x, weight=vec),
              "reduce": dict(grad_out=x, input=x, mean=vec, invstd=vec),
              "elemt": dict(grad_out=x, input=x, mean=vec, invstd=vec, weight=None, sum_dy=vec,
                            sum_dy_xmu=vec, count=60)}[func]
    with pytest.raises(bngrad.ArgumentValueError) as info:
        FUNCS[func](**kwargs)
    message = str(info.value)
    assert "expected shape (5,)" in message and "got shape (14,)" in message, message
    assert "5 channels on axis 1" in message, message
    assert "axis 3" in message and "channel_axis=3 (or -1)" in message, message
    FUNCS[func](**kwargs, channel_axis=-1)  # the advice works


def test_channel_axis_hint_only_where_some_axis_fits():
    """A plain wrong length gets no advice about axes that do not match it."""
    x = _nhwc()
    with pytest.raises(bngrad.ArgumentValueError) as info:
        bngrad.batch_norm_forward(x, np.ones(7, F32))
    assert "channel_axis" not in str(info.value), str(info.value)


def test_channel_axis_hint_with_several_matching_axes():
    x = np.zeros((2, 3, 8, 8), F32)
    with pytest.raises(bngrad.ArgumentValueError) as info:
        bngrad.batch_norm_forward(x, np.ones(8, F32))
    message = str(info.value)
    assert "axes 2 and 3" in message and "channel_axis" in message, message


@pytest.mark.parametrize("given", ["save_mean", "save_invstd"])
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_save_stats_one_without_the_other(given, train):
    """One statistic alone used to be dropped silently (and both recomputed): raise."""
    kwargs = {**_base()["backward"], "train": train}
    missing = "save_invstd" if given == "save_mean" else "save_mean"
    for absent in (None, np.empty(0, F32)):
        with pytest.raises(bngrad.ArgumentValueError) as info:
            bngrad.batch_norm_backward(**{**kwargs, missing: absent})
        message = str(info.value)
        assert "save_mean" in message and "save_invstd" in message, message


def test_save_stats_both_empty_still_mean_none():
    """An eval-mode forward returns empty (0,) statistics; passed on, both mean "none"."""
    kwargs = _base()["backward"]
    _, save_mean, save_invstd = bngrad.batch_norm_forward(
        **{**_base()["forward"], "train": False})
    assert save_mean.shape == save_invstd.shape == (0,)
    expected = bngrad.batch_norm_backward(**{**kwargs, "save_mean": None, "save_invstd": None})
    got = bngrad.batch_norm_backward(**{**kwargs, "save_mean": save_mean,
                                        "save_invstd": save_invstd})
    for g, e in zip(got, expected):
        np.testing.assert_array_equal(g, e)


@pytest.mark.parametrize("func", ["backward", "forward", "elemt"])
def test_out_with_wrong_dtype_is_a_type_error_naming_the_dtypes(func):
    out = np.empty((4, 3, 5), np.float64)
    with pytest.raises(bngrad.ArgumentTypeError) as info:
        FUNCS[func](**_base()[func], out=out)
    message = str(info.value)
    assert "out" in message and "float32" in message and "float64" in message, message
    assert "shape" not in message, message


@pytest.mark.parametrize("func", ["backward", "forward", "elemt"])
def test_out_with_wrong_shape_names_only_the_shape(func):
    out = np.empty((4, 3, 6), F32)
    with pytest.raises(bngrad.ArgumentValueError) as info:
        FUNCS[func](**_base()[func], out=out)
    message = str(info.value)
    assert "(4, 3, 5)" in message and "(4, 3, 6)" in message, message
    assert "dtype" not in message, message


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("func", ["backward", "forward"])
def test_negative_running_var_names_the_argument_order(func, train):
    """A variance is never negative: the usual cause is F.batch_norm's argument order."""
    running_var = np.array([1.0, -0.5, 2.0], F32)
    kwargs = {**_base()[func], "train": train, "running_var": running_var}
    before = kwargs["running_mean"].copy()
    with pytest.raises(bngrad.ArgumentValueError) as info:
        FUNCS[func](**kwargs)
    message = str(info.value)
    assert "running_var" in message and "-0.5" in message and "order" in message, message
    np.testing.assert_array_equal(kwargs["running_mean"], before)  # nothing updated


def test_forward_called_in_torch_argument_order_is_caught():
    """F.batch_norm's order (input, running_mean, running_var, weight, bias) passed positionally:
    the bias lands in running_var, and a trained bias has negative entries."""
    x = np.random.default_rng(2).standard_normal((4, 3, 5)).astype(F32)
    running_mean, running_var = np.zeros(3, F32), np.ones(3, F32)
    weight, bias = np.full(3, 1.5, F32), np.array([0.1, -0.2, 0.3], F32)
    with pytest.raises(bngrad.ArgumentValueError, match="running_var.*order"):
        bngrad.batch_norm_forward(x, running_mean, running_var, weight, bias, False)


def test_nan_running_var_is_still_accepted():
    """PyTorch's running_var becomes NaN after a batch of one element; not an order mistake."""
    kwargs = {**_base()["forward"], "train": False,
              "running_var": np.array([1.0, np.nan, 1.0], F32)}
    output, _, _ = bngrad.batch_norm_forward(**kwargs)
    assert np.isnan(output[:, 1]).all() and np.isfinite(output[:, [0, 2]]).all()


def test_torch_batch_norm_given_bngrads_order_is_caught():
    """The reverse mix-up: bngrad.torch.batch_norm takes F.batch_norm's order, so bngrad's order
    puts the bias in running_var."""
    torch = pytest.importorskip("torch")
    import bngrad.torch as bt

    x = torch.randn(4, 3)
    weight, bias = torch.ones(3), torch.tensor([0.1, -0.2, 0.3])
    running_mean, running_var = torch.zeros(3), torch.ones(3)
    with pytest.raises(ValueError, match="running_var.*order"):
        bt.batch_norm(x, weight, bias, running_mean, running_var, training=False)


@pytest.mark.parametrize("dtype", [F64, F32, np.float16, "bfloat16"])
def test_running_var_scan_names_the_first_negative_entry(dtype):
    """The scan (compiled for float32/float64, NumPy for halves) passes NaN and -0.0, and
    names the first negative entry, also in a strided view."""
    from bngrad import _validate
    from bngrad._dtypes import spec

    dtype = spec(dtype).numpy if isinstance(dtype, str) else np.dtype(dtype)
    values = np.array([np.nan, -0.0, 2.0, -3.0, -np.inf, 4.0]).astype(dtype)
    _validate.running_var(values[:3])
    for view, text in ((values, "-3 at channel 3"), (values[::2], "-inf at channel 2"),
                       (values[::-1], "-inf at channel 1")):
        with pytest.raises(bngrad.ArgumentValueError, match=text):
            _validate.running_var(view)


@pytest.mark.parametrize("func", DATA_FUNCS)
def test_list_input_says_how_its_dtype_came_about(func):
    """(Found by a newcomer.) input given as a list, read by NumPy as float64, and a float32
    grad_out: the message blamed grad_out's dtype without saying where input's came from."""
    kwargs = _base()[func]
    kwargs["input"] = kwargs["input"].tolist()
    with pytest.raises(TypeError, match="grad_out") as info:
        FUNCS[func](**kwargs)
    assert ("expected the dtype of input (float64), got dtype float32 (NumPy made float64 of "
            "the list given as input: pass arrays of the dtype you mean)" in str(info.value))


def test_fused_backward_list_input_says_how_its_dtype_came_about():
    from bngrad import fused
    kwargs = _base()["backward"]
    with pytest.raises(TypeError, match="NumPy made float64 of the list given as input"):
        fused.batch_norm_relu_backward(kwargs["grad_out"], kwargs["input"].tolist(),
                                       kwargs["weight"], kwargs["weight"],
                                       save_mean=kwargs["save_mean"],
                                       save_invstd=kwargs["save_invstd"])


def test_side_input_list_says_how_its_dtype_came_about():
    """(Found by hostile testing.) side_input as a list beside a float32 input."""
    from bngrad import fused
    x = _base()["forward"]["input"]
    with pytest.raises(TypeError, match="side_input") as info:
        fused.batch_norm_relu_forward(x, side_input=x.tolist())
    assert ("got dtype float64 (NumPy made float64 of the list given as side_input: pass "
            "arrays of the dtype you mean)" in str(info.value)), str(info.value)
    with pytest.raises(TypeError, match="side_input") as info:
        fused.batch_norm_relu_forward(x.tolist(), side_input=x)
    assert ("got dtype float32 (NumPy made float64 of the list given as input: pass arrays of "
            "the dtype you mean)" in str(info.value)), str(info.value)


@pytest.mark.parametrize("input_dtype, weight_dtype, advice", [
    (F64, F32, "np.asarray(weight, np.float64)"), (F32, F64, "np.asarray(weight, np.float32)"),
    (F32, np.float16, "np.asarray(weight, np.float32)")])
def test_weight_dtype_advice_names_a_dtype(input_dtype, weight_dtype, advice):
    """The advice was np.asarray(weight, input.dtype), which a list input has no dtype for."""
    x = np.zeros((4, 3, 5), input_dtype)
    with pytest.raises(TypeError, match="weight") as info:
        bngrad.batch_norm_forward(x.tolist() if input_dtype == F64 else x,
                                  np.ones(3, weight_dtype))
    assert advice in str(info.value), str(info.value)


def test_count_and_byte_order_messages_say_what_arrived():
    """(Found by a newcomer.) count=-1 was reported as "-1.0"; a byte-swapped array got the
    generic dtype message (and a dtype without a byte order must still get that one)."""
    kwargs = _base()["elemt"]
    for count, said in ((-1, "int -1"), (np.array(-1.0), "-1"), (np.float64(-2.5), "-2.5")):
        with pytest.raises(ValueError, match=f"count: expected a positive finite total, got "
                                             f"{said}$"):
            bngrad.batch_norm_backward_elemt(**{**kwargs, "count": count})
    strings = np.array([["1", "2"], ["3", "4"]], dtype=np.dtypes.StringDType())
    with pytest.raises(TypeError, match="input: expected a floating array"):
        bngrad.batch_norm_forward(strings)
    with pytest.raises(TypeError, match=r"byte-swapped: convert it with \.astype\('float32'\)"):
        bngrad.batch_norm_forward(kwargs["input"].astype(">f4"))
