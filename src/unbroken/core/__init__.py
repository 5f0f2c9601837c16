"""Layer 0, core: what every other layer uses and that knows nothing of runs.

The config dataclasses (`config`), fault injection for crash tests (`faults`), the Ray
Train names unbroken refuses (`ray_names`), the argument codec (`codec`: JSON, references
and per-argument pickles; fingerprints; constructor-argument binding), the stable names of
moved modules in stored data (`stable_names`), helpers for processes the driver starts
(`processes`), the intent of one fit() beyond its arguments (`run_spec`) and how a driver
tells the `unbroken run` supervisor which run or sweep it opened (`supervision`). The error
types are `unbroken.errors`, beside this package, because users import them from there.

May import: the standard library, third-party packages and `unbroken.errors` only.
"""
