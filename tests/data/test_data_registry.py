"""fedproto.data.registry: the one dataset registry."""








from fedproto.config.run_config import build_config
from fedproto.data.registry import DATASETS, PAPER_DATASETS


def test_one_dataset_registry():
    from fedproto import reproduce
    from fedproto.data.datasets import KNOWN_DATASETS
    from fedproto.reproduce import paper_numbers as paper

    for name, d in DATASETS.items():
        if d.loader is None:
            continue
        cfg = build_config(overrides={"dataset": name})
        assert (cfg.rounds, cfg.model, cfg.stdev, cfg.shots, cfg.test_shots, cfg.lam, cfg.num_classes) == (
            d.rounds, d.model, d.stdev, d.shots, d.test_shots, d.lambda_proto, d.classes)
        assert reproduce.MODELS[name] == d.model and reproduce.MH_MODELS[name] == d.mh_model
        assert name in KNOWN_DATASETS
    assert paper.DATASETS == PAPER_DATASETS == ("mnist", "femnist", "cifar10")
    assert paper.MAIN_STDEV == {"mnist": 2, "femnist": 1, "cifar10": 1}
    assert (DATASETS["cifar10"].lambda_proto, DATASETS["cifar10"].input_shape) == (0.1, (3, 32, 32))
