"""ledger"""
