"""linker"""
