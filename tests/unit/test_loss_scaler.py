"""fp16 dynamic loss scaling follows DeepSpeed's rule (DynamicLossScaler) on scripted overflows."""
import dataclasses

import pytest

from framework.core.errors import TrainingError
from framework.precision import PrecisionState, ScalerConfig, next_scale


def deepspeed_rule(cfg, pattern):
    """A direct transcription of the rule, written independently of next_scale."""
    scale, it, last, hyst, skipped, out = 2.0 ** cfg.initial_scale_power, 0, -1, cfg.hysteresis, 0, []
    for overflow in pattern:
        if overflow:
            if cfg.hysteresis == 1 or hyst == 1:
                scale = max(scale / 2, cfg.min_loss_scale)
            else:
                hyst -= 1
            last = it
            skipped += 1
        else:
            if cfg.consecutive_hysteresis:
                hyst = cfg.hysteresis
            stable = it - last - 1
            if stable > 0 and stable % cfg.loss_scale_window == 0:
                if not cfg.consecutive_hysteresis:
                    hyst = cfg.hysteresis
                scale *= 2
        it += 1
        out.append((scale, hyst, skipped))
    return out


def run(cfg, pattern):
    st = PrecisionState(cur_scale=2.0 ** cfg.initial_scale_power, cur_hysteresis=cfg.hysteresis)
    out = []
    for overflow in pattern:
        st = next_scale(cfg, st, overflow)
        out.append((st.cur_scale, st.cur_hysteresis, st.skipped_steps))
    return out


PATTERN = [True, False, False, True, True, False, False, False, False, False, False, True] + [False] * 12


@pytest.mark.parametrize("consecutive", [False, True])
@pytest.mark.parametrize("hysteresis", [1, 2, 3])
def test_matches_rule(consecutive, hysteresis):
    cfg = ScalerConfig(initial_scale_power=8, loss_scale_window=4, hysteresis=hysteresis,
                       consecutive_hysteresis=consecutive)
    assert run(cfg, PATTERN) == deepspeed_rule(cfg, PATTERN)


def test_hand_checked_trace():
    # hysteresis 2: the first overflow only spends hysteresis, the second halves the scale.
    cfg = ScalerConfig(initial_scale_power=4, loss_scale_window=2, hysteresis=2)
    trace = run(cfg, [True, True, False, False, False, False, False])
    assert [s for s, _, _ in trace] == [16, 8, 8, 8, 16, 16, 32]
    assert trace[-1][2] == 2  # two skipped steps


def test_min_scale_error_names_parameters():
    cfg = ScalerConfig(initial_scale_power=1, hysteresis=1, min_loss_scale=1.0)
    st = PrecisionState(cur_scale=1.0, cur_hysteresis=1)
    with pytest.raises(TrainingError, match=r"min_loss_scale=1.*h\.0\.attn\.weight"):
        next_scale(cfg, st, True, culprits=lambda: ["h.0.attn.weight"])
    for skipped, said in ((1, "after 1 skipped step. "), (2, "after 2 skipped steps. ")):   # counted
        with pytest.raises(TrainingError) as info:
            next_scale(cfg, dataclasses.replace(st, skipped_steps=skipped), True)
        assert said in str(info.value), str(info.value)


def test_static_and_no_scaler_only_count_skips():
    st = next_scale(None, PrecisionState(), True)
    assert (st.cur_scale, st.skipped_steps) == (1.0, 1)
    st = next_scale(ScalerConfig(loss_scale=128.0), PrecisionState(cur_scale=128.0), True)
    assert (st.cur_scale, st.skipped_steps) == (128.0, 1)


def test_fp16_keys_name_the_wrong_one_and_a_static_scale_refuses_the_dynamic_keys():
    from framework.core.errors import ConfigError
    from framework.precision.policies import FP16Config, check, fp16
    with pytest.raises(ConfigError, match=r"precision.hysteresis=5 has no effect with a static precision.loss_scale=128"):
        check("fp16", FP16Config(loss_scale=128.0, hysteresis=5))
    with pytest.raises(ConfigError, match=r"precision.loss_scale must be >= 0 \(0: dynamic\), got -1"):
        check("fp16", FP16Config(loss_scale=-1.0))
    with pytest.raises(ConfigError, match=r"precision.min_loss_scale must be > 0, got 0"):
        check("fp16", FP16Config(min_loss_scale=0.0))
    # hysteresis 1: every overflow lowers the scale, so there is no count for consecutive_hysteresis to restore
    with pytest.raises(ConfigError, match=r"^precision.consecutive_hysteresis=true has no effect with "
                                          r"precision.hysteresis=1 \(every overflow lowers the scale at once\); "
                                          r"remove it or set precision.hysteresis>1$"):
        check("fp16", FP16Config(hysteresis=1, consecutive_hysteresis=True))
    assert check("fp16", cfg := FP16Config(hysteresis=2, consecutive_hysteresis=True)) is cfg
    assert fp16(FP16Config(loss_scale=128.0)).scaler.loss_scale == 128.0


def test_fp16_refuses_a_min_scale_above_the_initial_scale():
    from framework.core.errors import ConfigError
    from framework.precision.policies import FP16Config, check, fp16
    with pytest.raises(ConfigError, match=r"precision.min_loss_scale=64 is above the initial scale "
                                          r"2\*\*precision.initial_scale_power=4"):
        check("fp16", FP16Config(initial_scale_power=2, min_loss_scale=64.0))
    assert fp16(FP16Config(initial_scale_power=6, min_loss_scale=64.0)).scaler.min_loss_scale == 64.0   # equal: fine


def test_fp16_refuses_a_static_scale_beyond_fp16():
    # A static 65536 (2**16, DeepSpeed's default initial dynamic scale) is a usual choice: accepted.
    from framework.core.errors import ConfigError
    from framework.precision.policies import FP16Config, check, fp16
    for bad in (1e30, 2.0 ** 33, float("inf"), float("nan")):
        with pytest.raises(ConfigError, match=r"precision.loss_scale=\S+ is above 2\*\*32"):
            check("fp16", FP16Config(loss_scale=bad))
    assert fp16(FP16Config(loss_scale=65536.0)).scaler.loss_scale == 65536.0
    assert fp16(FP16Config(loss_scale=32768.0)).scaler.loss_scale == 32768.0


@pytest.mark.parametrize("at", [2, 3, 8])
def test_a_switch_to_fp16_on_resume_grows_the_scale_after_a_full_window(at):
    """Resumed into fp16 from a state saved without dynamic scaling (fp32, bf16, a static scale) at step ``at``:
    the scale starts at the initial scale and first doubles after loss_scale_window clean steps, as in a
    fresh fp16 run (not at the next multiple of the window in the saved step count); counts carry over."""
    from framework.precision.policies import FP16Config, fp16

    policy = fp16(FP16Config(loss_scale_window=4))
    st = policy.continued(PrecisionState(cur_iter=at, skipped_steps=1))
    fresh = policy.init_state()
    assert (st.cur_scale, st.cur_iter, st.skipped_steps) == (fresh.cur_scale, at, 1)
    scales = []
    for _ in range(9):
        st, fresh = next_scale(policy.scaler, st, False), next_scale(policy.scaler, fresh, False)
        scales.append((st.cur_scale, fresh.cur_scale))
    assert all(a == b for a, b in scales), scales
