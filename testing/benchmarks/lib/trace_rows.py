"""The four ways the MLP benchmark traces `apply`: its trace table's rows."""

RETRACE = "re-trace"  # A model and input shape this process traced before.
NEW_SHAPE = "new input shape"  # The same model at a batch size never traced.
NEW_MODEL = "new model"  # Model objects this process never traced.
FRESH_PROCESS = "fresh process"  # A new process; `init` never ran there.
APPLY_ROWS = (RETRACE, NEW_SHAPE, NEW_MODEL, FRESH_PROCESS)
