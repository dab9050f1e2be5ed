"""mcf: fast, validated readers and writers for the on-disk formats ML infrastructure lives on."""
