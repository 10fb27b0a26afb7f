from pager.pages import page_count, page_slice
