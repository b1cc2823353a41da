"""A multi-node lab on one machine (network namespaces, veth, bridges, tc) and its launcher.

``lab`` is pure (names, addresses, command lists); ``netns`` runs those commands as root;
``launch`` starts one torchrun per node namespace (``amsp cluster run``).
"""
