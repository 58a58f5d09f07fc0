"""Placement rules several targets share (each target lists the ones it applies): the residual add and the
concatenation. A rule one target alone applies lives in that target's package."""
