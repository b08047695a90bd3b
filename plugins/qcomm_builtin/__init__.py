"""qcomm's built-in codecs, reached only through the ``qcomm.codecs`` entry points."""
