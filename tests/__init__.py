"""KVX test suite, a package so that test modules and their helpers import each other relatively."""
