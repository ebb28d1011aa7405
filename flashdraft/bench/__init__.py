"""`flashdraft bench`: datasets, the methods compared, the interleaved runner, metrics and the report."""
