"""The small shared layer every part stands on: files written whole (``files``), a local
folder or a gs:// URL (``storage``), this machine's process table (``procfs``) and
open-files limit (``limits``), light value classes (``plain``) and names imported on first
use (``lazy``), JSON text no encoder takes (``jsontext``), ``--env NAME=VALUE`` (``envargs``).
"""
