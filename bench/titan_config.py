"""The names of bench.titan_llama's torchtitan configs, importable where torchtitan is not (bench.gpu_compare builds
torchtitan's command line before any torchtitan runs)."""

PREFIX = "torchpre_"
# torchtitan 0.3.0's float8 recipes for linears (tensorwise is gone from it), set in its config, not its flags.
FLOAT8_RECIPES = ("rowwise", "rowwise_with_gw_hp")


def config_name(flavor: str, untied: bool = False, float8: str = "") -> str:
    """The --config of a run: torchpre_<flavor>, `_untied` for a flavor that ties its output projection but runs
    untied, `_float8_<recipe>` for float8 linears in the blocks."""
    return f"{PREFIX}{flavor}" + ("_untied" if untied else "") + (f"_float8_{float8}" if float8 else "")
