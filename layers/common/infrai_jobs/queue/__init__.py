"""queue"""
