"""An extra file of the word handler's archive (`--extra-files`), imported by the handler by its name."""

WEIGHTS = [0.5, 0.25, 0.125]
