"""Recovery, the driver's half: from a failed attempt to the next one. The worker's half is
`unbroken.worker.recovery`, and the messages between the two are
`unbroken.worker.recovery.messages`.

- `after_failure`: `Recovery`, what follows a final failure: a recovery in place, a
  just-in-time save, or a restart, as the failure policy allows; the failed group handed back.
- `failure_policy`: `FailurePolicy`, handed in: retry or raise, within `max_failures`.
- `in_place`: who stays, who starts again, the rank that sends its state.
- `just_in_time`: the offers, the saver, the bounded waits, the commit of the last round.
"""
