"""ReportRounds, the controller's pure bookkeeping of report rounds (no processes, no clock)."""

import pytest

from unbroken.errors import ReportMismatchError
from unbroken.execution.report_rounds import ReportRounds
from unbroken.worker.protocol import Report


def test_a_round_completes_when_every_rank_reported_it():
    rounds = ReportRounds(3)
    assert rounds.add_report(0, Report(1, {"loss": 1.0})) is None
    assert rounds.add_report(2, Report(1, {"loss": 3.0}, files=[])) is None
    complete = rounds.add_report(1, Report(1, {"loss": 2.0}))
    assert sorted(complete) == [0, 1, 2] and complete[0].metrics == {"loss": 1.0}
    assert rounds.pending == {} and rounds.reported == [1, 1, 1]


def test_an_incomplete_round_can_complete_while_every_missing_rank_is_still_running():
    rounds = ReportRounds(3)
    rounds.add_report(0, Report(4, {}))
    rounds.fail(0)  # rank 0 reported 4 and then failed: ranks 1 and 2 are finishing step 4
    assert rounds.can_complete()
    rounds.add_report(1, Report(4, {}))
    assert rounds.can_complete()
    rounds.fail(2)  # the last missing rank failed too: round 4 never completes
    assert not rounds.can_complete()


def test_nothing_pending_means_nothing_to_wait_for():
    rounds = ReportRounds(2)
    rounds.fail(1)
    assert not rounds.can_complete()
    rounds = ReportRounds(2)
    rounds.add_report(1, Report(1, {}))
    rounds.finish(0, 0)  # a finished rank will never send report 1
    assert not rounds.can_complete()


def test_uneven_report_counts_are_a_mismatch_once_a_rank_finished():
    rounds = ReportRounds(2)
    for it in (1, 2):
        rounds.add_report(0, Report(it, {}))
    rounds.add_report(1, Report(1, {}))
    rounds.check_counts()  # nobody finished yet: rank 1 may still report
    rounds.finish(1, 1)
    with pytest.raises(ReportMismatchError, match=r"rank 0: 2, rank 1: 1"):
        rounds.check_counts()
    even = ReportRounds(2)
    even.finish(0, 3)
    even.finish(1, 2)
    with pytest.raises(ReportMismatchError):
        even.check_counts()


def test_the_hang_clock_and_what_the_hang_error_names():
    rounds = ReportRounds(3, last_heard=100.0)
    assert rounds.hang_left(now=104.0, hang_s=10.0) == 6.0
    rounds.heard(105.0)
    assert rounds.hang_left(now=115.0, hang_s=10.0) == 0.0
    assert "no worker reported within 10 s" in str(rounds.hang_error(10.0))
    rounds.add_report(2, Report(7, {}))
    rounds.finish(1, 6)
    error = rounds.hang_error(10.0)
    assert "rank(s) [0] did not report iteration 7" in str(error) and "rank(s) [2] did" in str(error)
