"""`flashdraft bench`: the methods compared, the interleaved runner, metrics and the report (the evaluation sets and
replay live in `flashdraft.evaluation`)."""

# The methods `flashdraft.bench.methods` builds, named here so the command line can list them without importing
# torch (its modules import it at the top).
METHOD_NAMES = (
    "ar", "flashdraft", "flashdraft-hybrid", "flashdraft-plain", "flashdraft-lookup", "prompt-lookup", "assisted",
    "reference", "transformers-dflash", "llama.cpp", "llama.cpp-lookup", "llama.cpp-dflash",
)
DRAFT_METHODS = frozenset({  # need --draft
    "flashdraft", "flashdraft-hybrid", "reference", "transformers-dflash", "llama.cpp-dflash",
})
LLAMA_CPP_METHODS = frozenset({"llama.cpp", "llama.cpp-lookup", "llama.cpp-dflash"})  # need llama.cpp built
