"""Search-space domains inside lists (and tuples), as Ray Tune allows them in a param_space:
grid searches expand to Ray's product in Ray's order, other domains are drawn from the
trial's seeded generator, a list keeps being a list, and a sweep restored after its driver
was killed proposes the same configs. A list without domains stays a constant, described
exactly as before lists could hold domains, so sweeps saved then restore unchanged."""

import os

import pytest

from conftest import fifo, kill_and_reap, read_until_all, run_script, start_script
from tune_loops import BLOCK_ENV, tune_loop
from unbroken import tune
from unbroken.errors import SearchSpaceError, SweepMismatchError
from unbroken.train import RunConfig
from unbroken.tune import TuneConfig, Tuner
from unbroken.tune import search_space as ss


def configs(space, seed=1, n=None):
    return [ss.resolve(space, ss.sample(space, seed, i)) for i in range(n or ss.grid_size(space))]


def test_grid_searches_inside_lists_expand_to_rays_product_in_rays_order():
    # Ray Tune 2.x's order (generate_variants): every grid leaf by path, lists' positions
    # included, the first varying fastest.
    space = {"nn_layers": [tune.grid_search([16, 32]), tune.grid_search([8, 16])]}
    assert ss.grid_size(space) == 4
    assert [c["nn_layers"] for c in configs(space)] == [[16, 8], [32, 8], [16, 16], [32, 16]]
    assert [c["nn_layers"] for c in configs(space, n=6)][4:] == [[16, 8], [32, 8]], "num_samples repeats it"

    mixed = {"a": tune.grid_search([1, 2]), "z": {"grid_search": [0, 9]},  # Ray's literal form too
             "l": [{"grid_search": ["x", "y"]}, 5, {"w": tune.grid_search([7, 8])}]}
    got = [(c["a"], c["l"], c["z"]) for c in configs(mixed)]
    assert len(got) == 16
    assert got[:5] == [(1, ["x", 5, {"w": 7}], 0), (2, ["x", 5, {"w": 7}], 0), (1, ["y", 5, {"w": 7}], 0),
                       (2, ["y", 5, {"w": 7}], 0), (1, ["x", 5, {"w": 8}], 0)]
    assert got[8] == (1, ["x", 5, {"w": 7}], 9)

    # Positions sort by number, as Ray's path tuples do: [2] before [10].
    wide = {"l": [tune.grid_search([i, i + 100]) for i in range(12)]}
    assert configs(wide, n=3)[2]["l"] == [0, 101] + list(range(2, 12))
    assert ss.resolve(wide, ss.sample(wide, 1, 2 ** 10))["l"] == list(range(10)) + [110, 11]

    nested = {"t": (tune.grid_search([1, 2]), 3), "b": [[tune.grid_search(["p", "q"])]]}
    assert [(c["t"], c["b"]) for c in configs(nested)] == [((1, 3), [["p"]]), ((1, 3), [["q"]]),
                                                            ((2, 3), [["p"]]), ((2, 3), [["q"]])]


def test_sampled_domains_inside_lists_are_seeded_and_keep_lists_as_lists():
    space = {"layers": [tune.choice([1, 2]), 3, {"lr": tune.loguniform(1e-4, 1e-1)}],
             "pair": (tune.uniform(0, 1), "tag"), "n": tune.randint(0, 100),
             "double": tune.sample_from(lambda spec: spec.config.layers[0] * 2)}
    first = configs(space, seed=3, n=20)
    assert first == configs(space, seed=3, n=20), "the same (seed, index), the same config"
    assert first != configs(space, seed=4, n=20)
    for c in first:
        assert type(c["layers"]) is list and type(c["pair"]) is tuple
        assert c["layers"][0] in (1, 2) and c["layers"][1] == 3 and 1e-4 <= c["layers"][2]["lr"] <= 1e-1
        assert 0 <= c["pair"][0] <= 1 and c["pair"][1] == "tag"
        assert c["double"] == 2 * c["layers"][0]
    assert {c["layers"][0] for c in first} == {1, 2}
    values = ss.sample(space, 3, 0)
    assert sorted(values) == ["double", "layers/[0]", "layers/[2]/lr", "n", "pair/[0]"]
    assert isinstance(values["layers/[0]"], int), "a choice is stored by its index"


def test_a_plain_list_is_described_and_passed_on_exactly_as_before():
    const = [1, 2, {"a": 3}, ("b", 4)]
    space = {"x": tune.grid_search([1, 2]), "const": const, "pair": (1, 2), "deep": {"l": [[5]]}}
    assert ss.spec(space) == {"x": {"grid_search": [1, 2]}, "const": [1, 2, {"a": 3}, ["b", 4]],
                              "pair": [1, 2], "deep": {"l": [[5]]}}
    assert ss.shape(space) == {"x": {"grid_search": [1, 2]}, "const": "value", "pair": "value",
                               "deep/l": "value"}
    assert [path for path, _ in ss.leaves(space)] == ["x"]
    assert ss.resolve(space, ss.sample(space, 1, 0))["const"] is const, "the very same object"

    with_domain = {"layers": [tune.choice([1, 2]), 3]}
    assert ss.spec(with_domain) == {"layers": [{"__domain__": "choice", "categories": [1, 2]}, 3]}
    assert ss.shape(with_domain) == {"layers/[0]": {"__domain__": "choice", "categories": [1, 2]},
                                     "layers/[1]": "value"}


def test_domains_a_path_cannot_name_and_grids_optuna_cannot_run_are_refused_with_a_hint():
    from unbroken.tune.search import OptunaSearch

    with pytest.raises(SearchSpaceError, match="non-string key.*Hint: use string keys"):
        ss.leaves({"a": {1: [tune.uniform(0, 1)]}})
    with pytest.raises(SearchSpaceError, match=r"cannot run grid_search \(param_space\['l/\[1\]'\]\).*Hint"):
        OptunaSearch().total({"l": [1, tune.grid_search([1, 2])]}, 1)
    assert OptunaSearch().total({"l": [tune.uniform(0, 1), tune.choice([1, 2])]}, 3) == 3


def list_tuner(storage, name, **kw):
    space = {"layers": [tune.grid_search([1, 2]), tune.uniform(0, 1), {"k": tune.choice(["a", "b"])}, 7],
             "iterations": kw.pop("iterations", 1)}
    config = TuneConfig(**{"metric": "score", "mode": "max", "seed": 5, **kw})
    return Tuner(tune_loop, param_space=space, tune_config=config,
                 run_config=RunConfig(name=name, storage_path=storage))


LIST_DRIVER = """
import sys
from tune_loops import tune_loop
from unbroken import tune
from unbroken.train import RunConfig
space = {"layers": [tune.grid_search([1, 2]), tune.uniform(0, 1), {"k": tune.choice(["a", "b"])}, 7],
         "iterations": 3}
grid = tune.Tuner(tune_loop, param_space=space,
                  tune_config=tune.TuneConfig(num_samples=2, metric="score", mode="max", seed=7,
                                              max_concurrent_trials=1),
                  run_config=RunConfig(name=sys.argv[2], storage_path=sys.argv[1])).fit()
print("DONE", len(grid), grid.num_terminated, [r.config["layers"] for r in grid])
"""


def test_list_domains_sweep_killed_and_restored_proposes_the_same_configs(storage, tmp_path):
    block = str(tmp_path / "block")
    fifo(block, "trial_00002")
    driver = start_script(LIST_DRIVER, storage, "killed", **{BLOCK_ENV: block})
    read_until_all(driver, ["trial_00002 BLOCKING"])
    kill_and_reap(driver)
    os.remove(os.path.join(block, "trial_00002"))
    restored = Tuner.restore(os.path.join(storage, "killed"), tune_loop).fit()
    reference = run_script(LIST_DRIVER, storage, "reference")
    assert "DONE 4 4" in reference.stdout
    expected = Tuner.restore(os.path.join(storage, "reference"), tune_loop).get_results()
    assert [r.config for r in restored] == [r.config for r in expected]
    assert [r.config["layers"][0] for r in restored] == [1, 2, 1, 2]
    assert all(type(r.config["layers"]) is list and r.config["layers"][3] == 7 for r in restored)


def test_a_finished_sweep_with_list_domains_extends_resumes_and_keeps_its_shape(storage):
    first = list_tuner(storage, "grow").fit()
    path = os.path.join(storage, "grow")
    assert list_tuner(storage, "grow").fit().num_terminated == 2, "the same script auto-resumes it"
    grown = Tuner.restore(path, tune_loop, tune_config=TuneConfig(num_samples=2)).fit()
    larger = list_tuner(storage, "larger", num_samples=2).fit()
    assert [r.config for r in grown] == [r.config for r in larger]
    assert [r.config for r in grown][:2] == [r.config for r in first]
    changed = {"layers": [tune.grid_search([1, 2]), tune.uniform(0, 2), {"k": tune.choice(["a", "b"])}, 7],
               "iterations": 1}
    with pytest.raises(SweepMismatchError, match=r"layers/\[1\]"):
        Tuner.restore(path, tune_loop, param_space=changed)
    respecified = {"layers": [tune.grid_search([1, 2]), tune.uniform(0, 1), {"k": tune.choice(["a", "b"])},
                              8], "iterations": 1}
    grid = Tuner.restore(path, tune_loop, param_space=respecified).get_results()
    assert [r.config["layers"][3] for r in grid] == [8] * 4, "constants in the list may be re-specified"


def test_optuna_samples_domains_inside_lists(storage):
    pytest.importorskip("optuna")
    from unbroken.tune.search import OptunaSearch

    space = {"layers": [tune.uniform(0, 4), tune.choice([0.0, 0.5])], "iterations": 1}
    grid = Tuner(tune_loop, param_space=space,
                 tune_config=TuneConfig(metric="score", mode="max", num_samples=2, seed=1,
                                        search_alg=OptunaSearch()),
                 run_config=RunConfig(name="optuna-lists", storage_path=storage)).fit()
    assert grid.num_terminated == 2
    for r in grid:
        assert type(r.config["layers"]) is list and 0 <= r.config["layers"][0] <= 4
        assert r.config["layers"][1] in (0.0, 0.5)
