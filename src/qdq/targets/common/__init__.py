"""Placement rules several targets share (each target lists the ones it applies): the residual add, the
concatenation, attention and the output tail. A rule one target alone applies lives in that target's package."""
