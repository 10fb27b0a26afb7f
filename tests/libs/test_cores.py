"""temper.cores: each busy loop gets every core alone and an equal share with others, set in
its own thread only (torch's intra-op count is per OS thread under OpenMP)."""

from __future__ import annotations

import threading

import pytest
import torch

from temper import cores
from temper.cores import CoreShare

pytestmark = pytest.mark.usefixtures("torch_threads_restored")


def in_thread(call):
    out: list = []
    t = threading.Thread(target=lambda: out.append(call()))
    t.start()
    t.join()
    return out[0]


def test_a_loop_alone_gets_every_core_and_two_share_them():
    share = CoreShare(4)
    assert share.threads() == 4  # nobody busy: what a loop starting now gets
    with share.busy("engine"):
        assert share.threads() == 4
        with share.busy("trainer"):
            assert share.threads() == 2
            with share.busy("trainer"):  # nested marks of one loop count once
                assert share.threads() == 2
        assert share.threads() == 4
    share.set_busy("engine", True)
    share.set_busy("a", True)
    share.set_busy("b", True)
    assert share.threads() == 1  # 4 // 3, never 0 ...
    assert CoreShare(2).threads() == 2
    share.set_busy("c", True)
    share.set_busy("d", True)
    assert share.threads() == 1  # ... even with more loops than cores
    with pytest.raises(ValueError, match="at least one core"):
        CoreShare(0)


def test_fit_sets_the_calling_threads_count_and_no_other():
    torch.set_num_threads(1)
    share = cores.share(2)

    def trainer_step() -> tuple[int, int]:
        with share.busy("trainer"):
            alone = torch.get_num_threads()
            share.set_busy("engine", True)  # the engine starts mid-step
            cores.fit()  # the next micro-batch
            return alone, torch.get_num_threads()

    assert in_thread(trainer_step) == (2, 1)
    assert torch.get_num_threads() == 1  # this thread was never fitted
    share.set_busy("engine", False)
    assert in_thread(lambda: cores.run_busy("trainer", torch.get_num_threads)) == 2


def test_off_fit_and_run_busy_leave_torch_alone():
    torch.set_num_threads(1)
    cores.unshare()
    cores.fit()
    cores.set_busy("engine", True)
    assert cores.run_busy("trainer", torch.get_num_threads) == 1
    assert in_thread(lambda: cores.run_busy("trainer", torch.get_num_threads)) == 1
