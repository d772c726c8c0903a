"""Which Metal command-buffer limits to set. Standard library only: runs from the bootstrap."""

OPS, MB = "MLX_MAX_OPS_PER_BUFFER", "MLX_MAX_MB_PER_BUFFER"
# Measured on an M3 Ultra serving GLM-5.3-Flash (seed 003): +5% decode at a
# 20k context, +7.7% short, identical outputs, cold prefill unchanged. Larger
# limits (2048 MB / 100000 ops, seed 004) gained more at batch 1 but cost
# prefill, speculative and batched serving; these are the conservative pair.
DEFAULTS = {OPS: 200, MB: 400}
KNOBS = {OPS: "GLM53_COMMAND_BUFFERS_OPS", MB: "GLM53_COMMAND_BUFFERS_MB"}


def plan(environ, platform, mlx_loaded):
    """(variables to set, one-line note). Never overrides what the user set."""
    if platform != "darwin":
        return {}, "no Metal backend on this platform: nothing set"
    if mlx_loaded:
        return {}, "mlx was imported before the bootstrap ran: too late to set anything"
    changes, notes = {}, []
    for variable, default in DEFAULTS.items():
        knob = KNOBS[variable]
        value = environ.get(knob, str(default))
        if not value.isdigit() or int(value) <= 0:
            return {}, f"{knob}={value!r} is not valid; accepted: a positive integer -- nothing set"
        if variable in environ:
            notes.append(f"{variable}={environ[variable]} kept (set by you)")
        else:
            changes[variable] = value
            notes.append(f"{variable}={value} set")
    return changes, "; ".join(notes) + " (fewer command-buffer commits per decode step)"
