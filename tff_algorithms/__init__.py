"""TFF side of dp-fedemb, in eight layered packages (docs/layout.md): `base`,
`privacy`, `config`, `modeling`, `evaluation`, `federated`, `jobs` and `algorithms`.

Never imports `pipeline` (docs/design.md section 2).
"""
