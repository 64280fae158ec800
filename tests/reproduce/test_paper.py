"""fedproto.reproduce.paper_numbers: the paper's tables as data."""






from fedproto.reproduce import paper_numbers as paper


def test_paper_table_spot_checks():
    assert paper.accuracy("mnist", 2, "fedproto", 3) == (97.13, 0.30)
    assert paper.accuracy("cifar10", 2, "fedper", 5) == (72.43, 4.55)  # printed "72,43" (tab. 4)
    assert paper.accuracy("femnist", 1, "fedproto-mh", 3) == (97.10, 1.63)
    assert paper.accuracy("mnist", 3, "fedproto-mh", 5) == (95.56, 0.31)
    assert paper.accuracy("cifar10", 1, "local", 5) == (58.64, 6.57)
    assert paper.accuracy("digits", 1, "fedproto", 3) is None
    assert paper.rounds("femnist", "fedprox") == 300 and paper.rounds("mnist", "local") == 0
    assert paper.params_k("cifar10", "fedproto") == 41 and paper.params_k("femnist", "fedavg") == 16000
    # 3 datasets × 2 stdev levels × 8 methods × 3 ways
    assert len(paper.ACCURACY) == 144
    assert {m for (_, _, m, _) in paper.ACCURACY} == set(paper.METHODS)
    assert len(paper.ROUNDS) == len(paper.PARAMS_K) == 24
