"""Layer 4, execution: the driver side that takes a run through its attempts.

The `Controller` (`controller`, its states in `controller_state`), the report rounds
(`report_rounds`, pure), the driver's signal handling (`preemption`), the driver's half of
recovery (`recovery/`: the failure policy, in place, just in time), and the
engines that run worker groups (`engine/`: the interface in `base`, the choice of engine in
`factory`, `local` processes and `ray` actors).

May import: `core`, `state`, `store`, `run` and `worker`.
"""
