"""`flashdraft bench`: datasets, the methods compared, the interleaved runner, metrics and the report."""

# The methods `flashdraft.bench.methods` builds, named here so the command line can list them without importing
# torch (its modules import it at the top).
METHOD_NAMES = ("ar", "flashdraft", "prompt-lookup", "assisted", "reference", "transformers-dflash")
