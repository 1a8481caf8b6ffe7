"""The update every engine shares: optimizer recognition (:mod:`._recognize`, remembered per
transformation by :mod:`._memo`) and the step pipeline before the optimizer (:mod:`._pipeline`:
unscale, norm, finite check, skip, clip, metrics)."""
