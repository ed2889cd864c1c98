"""The 8 emulated CPU devices and the fleet reset live in the repository's conftest.py."""
