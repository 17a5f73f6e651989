"""Transforms of saved arrays, shared by every reader that renames, transposes, casts or
combines what it reads: `virtual.py` (an array as stored or computed from stored ones,
`VArray`) and `surgery.py` (the transforms themselves, `snapshard.safetensors.surgery` to
users). The safetensors loader and the torch loader apply them; neither wing is imported."""
