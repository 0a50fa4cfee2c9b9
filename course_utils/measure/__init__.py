"""Measurements the lessons and exercises use, one module per chapter (``measure.ch10`` holds
chapter 10's): they time, count and fit, and judge nothing.  Checkers live in ``course_utils.checks``.

Import them by chapter: ``from course_utils.measure.ch10 import fit_alpha_beta``.
"""
